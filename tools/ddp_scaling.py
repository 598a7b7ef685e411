"""DDP's published ResNet-50 scaling table, predicted by graphddp's cost model.

``python -m tools.ddp_scaling`` prints, for 1 to 16 V100s, the step DDP measured (pytorch/pytorch
``benchmarks/distributed/ddp/README.md``: ResNet-50, batch 32 per GPU, DGX-1 machines with 4x
100 Gb/s InfiniBand each, p50 seconds per iteration) beside the step graphddp predicts from two
things only: the measured single-GPU step without DDP (0.097 s) and the ``"dgx-1"`` link preset
(:mod:`graphddp.values.links`). No GPU, no torchvision: ResNet-50's parameters and FLOPs are
written below from its architecture (torchvision's ``resnet50``, 25,557,032 parameters), its
gradients bucketed as DDP buckets them (1 MB first, then 25 MB, in the order the backward
produces them), and the backward share of the single-GPU step spread over its layers by their
FLOPs; :func:`graphddp.simulate` then overlaps each bucket's all-reduce with the rest of it.
``tests/unit/test_scale.py`` holds the predictions to the table within 10%.
"""
from __future__ import annotations

import math

from graphddp.config import DDPConfig
from graphddp.plan.cost import simulate
from graphddp.plan.planner import plan
from graphddp.values import links
from graphddp.values.prediction import CostModel
from graphddp.values.schedule import GradSlot, GraphFacts, NodeFact

README = "https://github.com/pytorch/pytorch/blob/main/benchmarks/distributed/ddp/README.md"
SINGLE_GPU_S = 0.097  # 1 GPU, no DDP, p50
MEASURED_S = {1: 0.100, 2: 0.103, 4: 0.103, 8: 0.104, 16: 0.104}  # DDP, p50; 16 GPUs on 2 machines
BATCH = 32
# The backward's share of a step: a layer's backward computes the gradients of its input and of its
# weights, each about as much work as its forward, so the backward is about two thirds of the step.
BACKWARD_SHARE = 2 / 3

Layer = tuple[str, tuple[tuple[int, ...], ...], int]  # name, parameter shapes, forward FLOPs


def _conv(name: str, cin: int, cout: int, k: int, side: int) -> Layer:
    """A convolution without bias and its batch norm, at an output of ``side`` x ``side``."""
    return name, ((cout, cin, k, k), (cout,), (cout,)), 2 * cout * cin * k * k * side * side * BATCH


def resnet50() -> list[Layer]:
    """torchvision's ``resnet50`` (v1.5: the stride on the 3x3), layer by layer in forward order."""
    layers = [_conv("conv1", 3, 64, 7, 112)]
    inplanes, side = 64, 56
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)), start=1):
        for b in range(blocks):
            s = stride if b == 0 else 1
            out = side // s
            name = f"layer{stage}.{b}"
            layers += [_conv(f"{name}.conv1", inplanes, width, 1, side), _conv(f"{name}.conv2", width, width, 3, out),
                       _conv(f"{name}.conv3", width, 4 * width, 1, out)]
            if b == 0:
                layers.append(_conv(f"{name}.downsample", inplanes, 4 * width, 1, out))
            inplanes, side = 4 * width, out
    layers.append(("fc", ((1000, 2048), (1000,)), 2 * 2048 * 1000 * BATCH))
    return layers


def facts(layers: list[Layer]) -> GraphFacts:
    """The backward of ``layers``: one node per layer, last layer first, producing its gradients."""
    nodes, slots = [], []
    for position, (name, shapes, _) in enumerate(reversed(layers)):
        nodes.append(NodeFact(name=name, position=position, is_compute=True))
        for i, shape in enumerate(shapes):
            numel = math.prod(shape)
            slots.append(GradSlot(output_index=len(slots), param_name=f"{name}.{i}", shape=shape, dtype="float32", device="cuda",
                                  numel=numel, nbytes=4 * numel, producer=name, position=position))
    nodes.append(NodeFact(name="output", position=len(nodes), is_compute=False))
    return GraphFacts(tuple(nodes), tuple(slots))


def predicted_step(world_size: int, cost: CostModel, single_gpu_s: float = SINGLE_GPU_S) -> float:
    """One step on ``world_size`` GPUs: the forward as measured alone, then the backward's
    compute (measured, spread by FLOPs) with DDP's buckets all-reduced on ``cost``'s links."""
    layers = resnet50()
    backward_s = single_gpu_s * BACKWARD_SHARE
    total = sum(flops for _, _, flops in layers)
    measured = {name: backward_s * flops / total for name, _, flops in layers}
    schedule = plan(facts(layers), DDPConfig(bucket_cap_mb=25, first_bucket_cap_mb=1), world_size=world_size)
    return single_gpu_s - backward_s + simulate(schedule, cost, measured).step_seconds


def table(cost: CostModel | None = None) -> list[tuple[int, float, float]]:
    """(GPUs, measured seconds, predicted seconds) for every row of the README's table."""
    cost = cost or links.preset("dgx-1")
    return [(n, seconds, predicted_step(n, cost)) for n, seconds in MEASURED_S.items()]


def main() -> None:
    cost = links.preset("dgx-1")
    print(f"ResNet-50, batch {BATCH}, {cost.describe()}\nmeasured: {README}")
    print("| GPUs | DDP measured s | graphddp predicted s | predicted / measured |\n|---:|---:|---:|---:|")
    for n, measured, predicted in table(cost):
        print(f"| {n} | {measured:.3f} | {predicted:.4f} | {predicted / measured:.3f} |")


if __name__ == "__main__":
    main()
