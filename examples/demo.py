"""graphddp demo: 2 local CPU ranks (gloo) train a small GPT with graphddp, next to DDP.

Run ``python examples/demo.py`` (it relaunches itself under torchrun with 2 ranks), or
``torchrun --nproc-per-node 2 examples/demo.py`` directly. Prints the loss per step, the
bucket plan of every backward graph, and the largest difference to DDP's gradients.
"""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphddp
from graphddp.models import TinyGPT
from graphddp.testing import release_process_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    parser.add_argument("--bucket-cap-mb", type=float, default=0.05)
    parser.add_argument("--first-bucket-cap-mb", type=float, default=0.01)
    args = parser.parse_args()
    if "RANK" not in os.environ:  # relaunch under torchrun: the real multi-process launcher
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               "--standalone", __file__, *sys.argv[1:]]
        sys.exit(subprocess.call(cmd))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = TinyGPT(vocab=256, dim=64, heads=4, layers=2, seq=32)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ours = graphddp.compile(model, backend=args.backend, bucket_cap_mb=args.bucket_cap_mb,
                            first_bucket_cap_mb=args.first_bucket_cap_mb)
    opt = torch.optim.AdamW(ours.parameters(), lr=3e-3)
    opt_ddp = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank sees different data
    worst = 0.0
    for step in range(args.steps):
        idx = torch.randint(0, 256, (8, 33), generator=gen)
        x, y = idx[:, :-1], idx[:, 1:]
        losses = []
        for m, o in ((ours, opt), (ddp, opt_ddp)):
            o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
            loss.backward()
            losses.append(loss.detach())
        diff = max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(ours.module.parameters(), ddp.module.parameters()))
        worst = max(worst, diff)
        opt.step()
        opt_ddp.step()
        mean_loss = losses[0].clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step}: loss {mean_loss.item() / world:.4f}  max |grad - DDP grad| = {diff:.2e}")
    if rank == 0:
        for schedule in ours.schedules:
            print(f"\nschedule fingerprint {schedule.fingerprint()}")
            print(schedule.to_table())
        verdict = "agree" if worst < 1e-5 else "DISAGREE"
        print(f"\ngradients {verdict} with DDP over {args.steps} steps on {world} ranks "
              f"(largest difference {worst:.2e}, backend={args.backend})")
    # Tear down together, and drop what holds the process group first: in one fresh-clone run a
    # rank that destroyed gloo while its peer was still printing aborted at exit (SIGABRT,
    # "terminate called without an active exception") after the demo had passed.
    dist.barrier()
    del ours, ddp, opt, opt_ddp
    release_process_group()  # Dynamo's caches also hold the modules: drop them, then destroy
    if worst >= 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    main()
