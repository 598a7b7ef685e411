"""tools.bench: the benchmark, graphddp next to DDP (eager and compiled), no overlap, and two bounds.

One launch, 2 spawned CPU ranks (gloo, one thread each), one process group; every mode trains
a copy of the same model on the same per-rank batch from the same seed. Modes run round-robin
(one step each per round, the order rotated every round) after warm-up rounds; each step is
fenced by ``dist.barrier()``; a mode's step time is the median over steps of the slowest rank.
Every mode trains with the same optimizer, ``torch.optim.AdamW(lr=1e-4, weight_decay=0.01)``
(``workload.make_optimizer``), stepped after the backward unless said otherwise.

Modes
  compute_only      torch.compile(model) (inductor), no communication; fwd/bwd/opt timed apart
  compute_eager     the eager model, no communication: the compute eager DDP does (diagnostic)
  comm_only         graphddp's own bucket list (sizes and dtypes from ``model.schedules``),
                    all-reduced back to back on preallocated flat tensors, one at a time
  ideal_overlap     torch.compile(model) with graphddp's buckets all-reduced asynchronously from
                    the start of backward, on their own tensors (no dependency on gradients):
                    the step the link and the communication's CPU cost allow, measured
  no_overlap        torch.compile(model), then after backward one flat all-reduce of all grads
                    (cat, all_reduce, divide, copy back)
  ddp_default       DistributedDataParallel, eager, default bucket caps (25 MB, first 1 MB)
  ddp_same_buckets  DDP with ``bucket_cap_mb_list`` = graphddp's bucket sizes, in issue order
  ddp_cap{1,2,4,8,25}
                    DDP with bucket_cap_mb 1, 2, 4, 8, 25 (ddp_cap2 and ddp_cap8 only when named, or
                    by ``--modes sweep``); ``ddp_best`` is the fastest of those that ran
  ddp_compiled      DDP(torch.compile(model)) with Dynamo's DDPOptimizer, DDP's default caps, as
                    users write it (checked: > 1 graph); ddp_compiled_samecap: the same with
                    graphddp's bucket_cap_mb, a like-for-like split (reported, not a target)
  ddp_compiled_autograd
                    torch.compile(DDP(model)) built with optimize_ddp="python_reducer", its
                    backward under compiled autograd, inductor's DDP fusion passes
                    (fuse_ddp_with_coalesced_op, schedule_comm_wait) at DDP's caps: PyTorch's
                    whole-backward DDP (checked: its gradients are the ranks' average)
  graphddp          graphddp.compile(model, backend="inductor", bucket caps per model (gpt: 2 MB,
                    first 1 MB, last 1 MB; see ``workload.model_spec``)), separate optimizer
  graphddp_optim    graphddp.compile(model, optimizer=AdamW(...)): the same caps, each bucket's
                    parameters updated inside the backward right after its wait; step() and
                    zero_grad() are no-ops, so the update's time is in bwd (checked: one
                    step against torch.optim's AdamW on a copy)
  graphddp_optim_clip
                    graphddp_optim with max_grad_norm=1.0 (nanoGPT's grad_clip): each bucket's gradient
                    norms after its wait, every update after the last wait; graphddp_clip: graphddp
                    with clip_grad_norm_(params, 1.0) after the backward (timed as comm), then the
                    optimizer; both only when named, or by ``--modes clip``
  graphddp_auto     graphddp.compile(model, bucket_cap_mb="auto", graphddp's other options, first/last
                    caps unset): the buckets minimise the predicted backward under the cost model
                    calibrated on the process group (issue 12)
  graphddp_cap{1,2,4,8,25}
                    graphddp at bucket_cap_mb 1, 2, 4, 8, 25, first/last caps unset (DDP's semantics
                    for a set cap); only when named, or by ``--modes sweep``. ``best_swept`` is the
                    fastest of the graphddp_cap and ddp_cap modes that ran (in runs with
                    graphddp_auto or a graphddp_cap mode)
  graphddp_powersgd graphddp.compile(model, comm_hook=graphddp.hooks.PowerSGD(rank --powersgd-rank,
                    start_powerSGD_iter=2, DDP's other defaults)), graphddp's caps, separate optimizer
  ddp_powersgd      DDP eager + DDP's powerSGD_hook (same settings) on ONE bucket (bucket_cap_mb = the
                    model's gradients + 1 MB): with gloo the hook deadlocks when more than one bucket
                    is in flight; one bucket never overlaps the backward
  ddp_powersgd_serial
                    DDP eager, default caps, powerSGD_hook waited per bucket inside the hook (DDP's
                    math, no deadlock, no overlap)
                    The PowerSGD modes are stepped past start_powerSGD_iter and their first
                    compressed step before the timed rounds (checked: every timed step compresses);
                    the report adds bytes on the wire per rank per step next to graphddp and
                    ddp_default, the same gradients uncompressed (``powersgd.py``). Issue 13's rows:
                    ``--model mlp --link-gbit 1 --modes graphddp,graphddp_powersgd,ddp_default,
                    ddp_powersgd,ddp_powersgd_serial``

Issue 12's sweep: ``--modes sweep`` = graphddp_auto, graphddp_cap{1,2,4,8,25}, ddp_cap{1,2,4,8,25},
ddp_default, compute_only (and graphddp, which always runs). Targets: graphddp_auto / best_swept
<= 0.97, graphddp_auto / ddp_default <= 0.90, each evaluated when its modes ran.

Predicted backward (``pred bwd``, ``predict.py``): every rank calls
``graphddp.runtime.calibrate.calibrate(WORLD, cpu)`` once, before any mode is built (a collective; the
cached result is what graphddp_auto's planner uses too); bench.json records the cost model and
its source. For every graphddp* mode, ``graphddp.plan.cost.simulate(schedule, cost).step_seconds``
summed over its schedules; for ddp_default and ddp_cap{c}, graphddp's model of that bucket
layout (``graphddp.plan.planner.plan`` at DDP's caps on graphddp's backward graph, simulated), not of
eager DDP's compute. The table shows it next to the measured bwd, with bwd/pred.

Memory: ``peak MB`` is the allocator's peak during one profiled step above its start, plus
the gradients alive at its start (kept between steps by every mode but graphddp_optim) and
DDP's reducer bucket buffers. Targets of issue 11: graphddp_optim / best eager DDP and
graphddp_optim / ddp_compiled_autograd <= 0.90; graphddp_optim's peak <= the best eager DDP's
peak less the gradient bytes.

Bounds
  max(compute, comm)  max(compute_only step, comm_only step)
  release-time        fwd + max(bwd, link finish) + opt of compute_only, where the link carries
                      one bucket at a time, bucket i no earlier than its gradients are ready;
                      ready times = per-bucket ready fraction measured with post-accumulate-grad
                      hooks on the eager backward, times compute_only's backward time; the link
                      is graphddp.plan.cost.simulate with an alpha-beta CostModel fitted to
                      comm_only's per-bucket medians (``release.py``).

Network: ``--link-gbit R`` (default 2) re-executes the benchmark under ``unshare -n`` in a
private network namespace whose loopback carries a ``tbf`` rate limit of R Gbit/s. Both ranks'
traffic goes through that one qdisc: a 2-rank all-reduce of B bytes puts 2B on it, so it takes
about 16 B / R ns. ``--link-gbit 0`` (or a failure to build the namespace) uses the plain
loopback, whose all-reduce is CPU-bound; the table and JSON say which one ran.

Output: a table on the terminal, ``bench.json`` and ``bench.png`` (needs matplotlib) in --out.
"""

from __future__ import annotations
