"""The optimizer inside the backward on convolution models under inductor's layout optimization.

Inductor lays convolution graphs out channels-last (``torch._inductor.config.layout_optimization``,
on by default; on CPU with mkldnn it is taken for every convolution graph, on GPUs by a
heuristic that convolution models pass). The compiled forward then saves for the backward a
channels-last copy of each convolution weight, where AOTAutograd traced the parameter itself.
An update spliced through that saved input would write the copy and leave the parameter as it
was. The cases here force the optimization on (``force_layout_optimization``, so that the
condition holds whatever the machine's heuristic says), check that the compiled backward
really receives a re-laid-out weight, and train next to DDP + the same torch.optim in the
three modes that update inside: the replicated optimizer, ``sharding="optimizer"`` and
``sharding="full"``, one case each (the ResNet with SGD replicated, the depthwise net with SGD
sharded and with AdamW fully sharded). The models are torchvision-shaped: a ResNet (7x7 stem, BatchNorm,
3x3 basic blocks with a residual and a 1x1 downsample) and a MobileNet-like depthwise-separable
net. Tolerances as in test_optim_ranks.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_optim_ranks import ADAM_NOISE, TIGHT, assert_state_dicts_equal
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp.testing import spawn, update_runs

STEPS = 3


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 convolutions with BatchNorm, the input added back
    (through a strided 1x1 convolution and BatchNorm where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    """torchvision's ResNet layout at toy width: 7x7 stride-2 stem, BatchNorm, max pool, two
    basic blocks (the second strided, with a downsample), global average pool, a linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8)
        self.layer1, self.layer2 = BasicBlock(8, 8, 1), BasicBlock(8, 16, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class DepthwiseNet(nn.Module):
    """MobileNet-shaped: a 3x3 stem, then depthwise 3x3 (``groups=channels``) and pointwise 1x1
    convolutions, each with BatchNorm and ReLU6, global average pool, a linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()

        def conv_bn(cin: int, cout: int, k: int, stride: int, groups: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU6())

        self.features = nn.Sequential(
            conv_bn(3, 8, 3, 2),
            conv_bn(8, 8, 3, 1, groups=8), conv_bn(8, 16, 1, 1),
            conv_bn(16, 16, 3, 2, groups=16), conv_bn(16, 16, 1, 1),
        )
        self.classifier = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def _loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    return F.cross_entropy(m(x), y, label_smoothing=0.1)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    """torchvision's classification reference: SGD with momentum and weight decay."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    sharding: str | None = None
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    # A convolution weight that the forward should save re-laid-out (the condition under test);
    # only the replicated and optimizer-sharded modes save the parameter itself to be copied.
    relaid: str | None = "conv1.weight"


# One case per mode, each model and each optimizer in at least one: the C++ builds of every
# case are the cost (each case compiles its own kernels), not the steps.
CASES = {
    "resnet_sgd": Case(TinyResNet, _sgd),
    "depthwise_sgd_sharded": Case(DepthwiseNet, _sgd, "optimizer", relaid="features.0.0.weight"),
    "depthwise_adamw_full": Case(DepthwiseNet, _adamw, "full", tol=ADAM_NOISE, relaid=None),
}


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    from torch._inductor import config as inductor_config

    with inductor_config.patch(force_layout_optimization=True):
        _train_case(case, name, rank)


def _train_case(case: Case, name: str, rank: int) -> None:
    torch.manual_seed(0)
    base = case.make()
    mine = copy.deepcopy(base)
    if rank == 1:  # rank 0's parameters must win
        with torch.no_grad():
            for p in mine.parameters():
                p.add_(0.1)
    ref = DDP(copy.deepcopy(base))
    opt, ref_opt = case.optimizer(mine), case.optimizer(ref.module)
    kwargs: dict[str, Any] = {} if case.sharding is None else {"sharding": case.sharding}
    if case.sharding != "full":
        kwargs["bucket_cap_mb"] = 0.004  # a few buckets
    ours = graphddp.compile(mine, optimizer=opt, backend="inductor", **kwargs)
    for step in range(STEPS):
        for model, o in ((ours, opt), (ref, ref_opt)):
            _loss(model, rank, step).backward()
            o.step()
            o.zero_grad()
        whole = dict(ours.named_parameters())  # sharding="full": gathered whole
        for n, q in ref.module.named_parameters():
            torch.testing.assert_close(whole[n].detach(), q.detach(), **case.tol, msg=lambda m: f"{name} step {step} {n}: {m}")
        buffers = dict(mine.named_buffers())  # BatchNorm's running statistics
        for n, b in ref.module.named_buffers():
            torch.testing.assert_close(buffers[n], b, **case.tol, msg=lambda m: f"{name} step {step} buffer {n}: {m}")
        assert all(p.grad is None for p in mine.parameters()), f"{name} step {step}: a gradient kept"
        state = graphddp.full_optimizer_state_dict(ours) if case.sharding else opt.state_dict()
        assert_state_dicts_equal(state, ref_opt.state_dict(), case.tol, f"{name} step {step}")
    if case.sharding == "full":
        assert ours.updates.get("inside") == STEPS, f"{name}: updates {ours.updates}, expected every step inside"
    else:
        runs = update_runs(ours)
        assert runs == [(STEPS, 0)], f"{name}: (in-graph, after-backward) steps {runs}"
        _assert_relaid(ours, mine, case.relaid, name)


def _assert_relaid(ours: Any, mine: nn.Module, param: str, name: str) -> None:
    """The compiled backward receives a saved input shaped as ``param`` but with other strides:
    the forward saved a re-laid-out copy, which an update written through it would miss."""
    p = dict(mine.named_parameters())[param]
    code = ours.records[0].generated_code
    assert code is not None, f"{name}: no generated code recorded"
    shape = ", ".join(str(d) for d in p.shape)
    strides = {m.group(1) for m in re.finditer(rf"assert_size_stride\(\w+, \({shape}\), \(([\d, ]+)\)", code)}
    want = ", ".join(str(s) for s in p.stride())
    assert strides - {want}, f"{name}: the backward reads {param} ({shape}) only with strides {strides}: no copy was saved"


@pytest.mark.parametrize("name", list(CASES))
def test_update_inside_conv_models_under_layout_optimization(name: str) -> None:
    spawn(_train, 2, name)
