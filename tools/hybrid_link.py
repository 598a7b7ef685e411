"""Hybrid sharding on two emulated nodes: a slow link between them, a fast one inside each.

``python -m tools.hybrid_link`` (root, iproute2) makes two network namespaces of its own,
``gddp_a`` and ``gddp_b``, joined by one veth pair whose two ends are rate-limited by tbf (the link
between nodes); ranks in one namespace talk over its loopback, unlimited (the link inside a
node). Four gloo ranks, two per namespace, train the same MLP with AdamW for each mode in turn,
interleaved over ``--rounds``: ``sharding="optimizer"`` over all four ranks, and over a 2 x 2
``device_mesh=`` (hybrid: reduce-scatter and all-gather inside a node, one part all-reduced
between nodes); the same two with ``sharding="full"``. It prints each mode's median step and
the bytes each rank sends to the other node per step, counted from the compiled graphs'
collectives on groups spanning both nodes: gloo runs a reduce-scatter and an all-gather as
all-to-alls (``graphddp.values.collectives``), which send each peer its share, half of them on
the other node here; an all-reduce over the two replicas sends its whole input once (a ring of
two). The namespaces are removed at the end.

Nothing outside the two namespaces is touched; traffic goes only between them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NS = ("gddp_a", "gddp_b")
ADDR = ("10.77.0.1", "10.77.0.2")
DEV = ("gddp_va", "gddp_vb")
MODES = ("optimizer_flat", "optimizer_hybrid", "full_flat", "full_hybrid")


def _sh(*cmd: str) -> None:
    subprocess.run(list(cmd), check=True, capture_output=True, text=True)


def setup(gbit: float) -> None:
    teardown()
    for ns in NS:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    _sh("ip", "link", "add", DEV[0], "netns", NS[0], "type", "veth", "peer", "name", DEV[1], "netns", NS[1])
    rate = gbit * 1e9 / 8
    for ns, dev, addr in zip(NS, DEV, ADDR):
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit",
            "burst", str(max(256 * 1024, int(rate * 0.001))), "latency", "200ms")


def teardown() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _launch(mode: str, steps: int, width: int, port: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(4):
        node = rank // 2
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR=ADDR[0], MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME=DEV[node], PYTHONPATH=root, OMP_NUM_THREADS="1")
        cmd = ["ip", "netns", "exec", NS[node], sys.executable, "-m", "tools.hybrid_link", "--worker", mode,
               "--steps", str(steps), "--width", str(width)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode}: a rank failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def worker(mode: str, steps: int, width: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import graphddp
    from graphddp.models import MLP
    from graphddp.values.comm import group_of, is_collective

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sharding, layout = mode.split("_")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if layout == "hybrid" else None
    torch.manual_seed(0)
    model = MLP(width=width, depth=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gd = graphddp.compile(model, optimizer=opt, sharding=sharding, device_mesh=mesh, backend="aot_eager", bucket_cap_mb=4)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    times = []
    for step in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        F.mse_loss(gd(x), y).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    # Bytes this rank sends per step to the other node (module docstring).
    spanning = {dist.group.WORLD.group_name} | ({mesh.get_group(0).group_name} if mesh is not None else set())
    graphs = [r.graph for r in gd.records] if sharding == "optimizer" else [g for kind, g in gd.graphs if kind != "backward_update"]
    all_to_all = torch.ops._c10d_functional.all_to_all_single.default
    sent = 0.0
    for gm in graphs:
        for n in gm.graph.nodes:
            if is_collective(n) and group_of(n) in spanning:
                val = n.args[0].meta["val"]
                size = val.numel() * val.element_size()
                sent += size * 2 / 4 if n.target is all_to_all else size  # half the peers are on the other node; a ring of two
    if rank == 0:
        print(json.dumps({"mode": mode, "step_ms": [t * 1e3 for t in times], "cross_node_bytes": sent}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no teardown of gloo's pairs while peers exit (a rank once aborted there)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.hybrid_link", description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=MODES)
    p.add_argument("--gbit", type=float, default=0.5, help="the link between the two nodes, Gbit/s")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.width)
        return 0
    setup(args.gbit)
    try:
        runs: dict[str, list[float]] = {m: [] for m in MODES}
        sent: dict[str, int] = {}
        port = 29610
        for _ in range(args.rounds):
            for mode in MODES:
                out = _launch(mode, args.steps, args.width, port)
                port += 1
                runs[mode] += out["step_ms"]
                sent[mode] = out["cross_node_bytes"]
        print(f"4 gloo ranks on 2 emulated nodes, {args.gbit:g} Gbit/s between them; MLP width {args.width}, depth 6, AdamW")
        print(f"{'mode':<18} {'median step ms':>15} {'min':>8} {'max':>8} {'to the other node / step':>25}")
        for mode in MODES:
            ms = runs[mode]
            print(f"{mode:<18} {statistics.median(ms):>15.1f} {min(ms):>8.1f} {max(ms):>8.1f} {sent[mode] / 1e6:>22.2f} MB")
    finally:
        teardown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
