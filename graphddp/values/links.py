"""Named machines to plan for before renting them: GPUs, the link inside a node, the network
between nodes, and how they combine into a :class:`~graphddp.values.prediction.Topology`.

Every figure is a vendor's or a standard's published peak, cited beside it; a link's bandwidth is
one direction's (what a ring step sends), half of NVIDIA's bidirectional NVLink figure. Latencies
are NCCL's own model of one ring step (``src/graph/tuning.cc`` in NVIDIA/nccl, ``hwLat`` of the
ring algorithm's Simple protocol: 3.4 us over NVLink, 9.6 us over the network), which does not
tell InfiniBand from RoCE Ethernet. Compute is the dense FP16/BF16 tensor-core peak, memory the
HBM bandwidth: a plan's compute lane is as optimistic as those, which is why a measured step
(``graphddp.simulate(..., measured=)``) is the better base where one exists.

A name is a DGX node (``"dgx-h100"``, ``"dgx-a100"``, ``"dgx-1"``) or ``"GPU+NETxK"``: 8 GPUs
per node with K NICs of NET (``"h100+ndr400x8"``, ``"a100+eth100"``; K defaults to 1).
"""
from __future__ import annotations

import dataclasses

from graphddp.values.prediction import Topology

NCCL_TUNING = "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc"
NVLINK_LATENCY_US = 3.4  # NCCL_TUNING: hwLat[NVLINK][RING][SIMPLE]
NET_LATENCY_US = 9.6  # NCCL_TUNING: hwLat[NET][RING][SIMPLE]


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU and its node's link: peak tensor compute, HBM bandwidth, NVLink per direction."""

    compute_tflops: float
    memory_gbps: float
    nvlink_gbps: float  # gigabits per second, one direction
    source: str


@dataclasses.dataclass(frozen=True)
class Network:
    """One NIC's rate between nodes."""

    gbps: float
    source: str


GPUS = {
    # H100 SXM5: 989 TFLOPS BF16 dense (1,979 with sparsity), 3.35 TB/s HBM3, NVLink 4 900 GB/s bidirectional.
    "h100": Gpu(989.0, 3350.0, 450 * 8, "https://www.nvidia.com/en-us/data-center/h100/"),
    # A100 SXM4 80GB: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, NVLink 3 600 GB/s bidirectional.
    "a100": Gpu(312.0, 2039.0, 300 * 8, "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # V100 SXM2: 125 TFLOPS FP16 tensor, 900 GB/s HBM2, NVLink 2 300 GB/s bidirectional.
    "v100": Gpu(125.0, 900.0, 150 * 8, "https://images.nvidia.com/content/technologies/volta/pdf/"
                "volta-v100-datasheet-update-us-1165301-r5.pdf"),
}

_IBTA = "https://www.infinibandta.org/infiniband-roadmap/"  # 4x port rates: EDR 100, HDR 200, NDR 400 Gb/s
NETWORKS = {
    "ndr400": Network(400.0, _IBTA),
    "hdr200": Network(200.0, _IBTA),
    "edr100": Network(100.0, _IBTA),
    "eth100": Network(100.0, "https://www.ieee802.org/3/ba/"),  # IEEE 802.3ba: 100GBASE
    "eth25": Network(25.0, "https://www.ieee802.org/3/by/"),  # IEEE 802.3by: 25GBASE
}

# (gpu, network, NICs per node): the compute fabric of NVIDIA's 8-GPU nodes.
NODES = {
    # DGX H100: 8x single-port ConnectX-7, 400 Gb/s InfiniBand each.
    "dgx-h100": ("h100", "ndr400", 8, "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"),
    # DGX A100: 8x single-port ConnectX-6, 200 Gb/s HDR InfiniBand each.
    "dgx-a100": ("a100", "hdr200", 8, "https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html"),
    # DGX-1 with V100: 4x 100 Gb/s EDR InfiniBand (as pytorch/pytorch's benchmarks/distributed/ddp/README.md ran on).
    "dgx-1": ("v100", "edr100", 4, "https://github.com/pytorch/pytorch/blob/main/benchmarks/distributed/ddp/README.md"),
}


def topology(gpu: str, network: str, nics_per_node: int = 1, gpus_per_node: int = 8, source: str = "") -> Topology:
    """Nodes of ``gpus_per_node`` ``gpu``s on their NVLink, joined by ``nics_per_node`` NICs of ``network``."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}: one of {sorted(GPUS)}")
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}: one of {sorted(NETWORKS)}")
    g, net = GPUS[gpu], NETWORKS[network]
    name = source or f"{gpu}+{network}x{nics_per_node}"
    return Topology(
        bandwidth_gbps=g.nvlink_gbps, latency_us=NVLINK_LATENCY_US, compute_tflops=g.compute_tflops, memory_gbps=g.memory_gbps,
        gpus_per_node=gpus_per_node, nics_per_node=nics_per_node, inter_bandwidth_gbps=net.gbps,
        inter_latency_us=NET_LATENCY_US, source=f"preset {name}",
    )


def names() -> list[str]:
    """The names :func:`preset` takes: the nodes, then every GPU with every network (one NIC)."""
    return [*NODES, *(f"{g}+{n}" for g in GPUS for n in NETWORKS)]


def preset(name: str) -> Topology:
    """The topology called ``name`` (module docstring)."""
    if name in NODES:
        gpu, network, nics, _ = NODES[name]
        return topology(gpu, network, nics, source=name)
    gpu, _, rest = name.partition("+")
    network, _, nics = rest.partition("x")
    if not rest or (nics and not nics.isdigit()) or gpu not in GPUS or network not in NETWORKS:
        raise ValueError(f"unknown link preset {name!r}: one of {list(NODES)} or GPU+NET[xNICS] with GPU in {sorted(GPUS)}, "
                         f"NET in {sorted(NETWORKS)}")
    return topology(gpu, network, int(nics) if nics else 1, source=name)
