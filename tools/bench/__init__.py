"""tools.bench: the benchmark, graphddp next to DDP (eager and compiled), no overlap, and two bounds.

One launch, 2 spawned CPU ranks (gloo, one thread each), one process group; every mode trains
a copy of the same model on the same per-rank batch from the same seed. Modes run round-robin
(one step each per round, the order rotated every round) after warm-up rounds; each step is
fenced by ``dist.barrier()``; a mode's step time is the median over steps of the slowest rank.

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
  ddp_cap{1,4,25}   DDP with bucket_cap_mb 1, 4, 25; ``ddp_best`` is the fastest of the three
  ddp_compiled      DDP(torch.compile(model)) with Dynamo's DDPOptimizer, DDP's default caps, as
                    users write it (checked: > 1 graph); ddp_compiled_samecap: the same with
                    graphddp's bucket_cap_mb, a like-for-like split (reported, not a target)
  graphddp          graphddp.compile(model, backend="inductor", bucket caps per model (gpt: 2 MB,
                    first 1 MB, last 1 MB; see ``workload.model_spec``))

Bounds
  max(compute, comm)  max(compute_only step, comm_only step)
  release-time        fwd + max(bwd, link finish) + opt of compute_only, where the link carries
                      one bucket at a time, bucket i no earlier than its gradients are ready;
                      ready times = per-bucket ready fraction measured with post-accumulate-grad
                      hooks on the eager backward, times compute_only's backward time; the link
                      is graphddp.cost.simulate with an alpha-beta CostModel fitted to
                      comm_only's per-bucket medians (``release.py``).

Network: ``--link-gbit R`` (default 2) re-executes the benchmark under ``unshare -n`` in a
private network namespace whose loopback carries a ``tbf`` rate limit of R Gbit/s. Both ranks'
traffic goes through that one qdisc: a 2-rank all-reduce of B bytes puts 2B on it, so it takes
about 16 B / R ns. ``--link-gbit 0`` (or a failure to build the namespace) uses the plain
loopback, whose all-reduce is CPU-bound; the table and JSON say which one ran.

Output: a table on the terminal, ``bench.json`` and ``bench.png`` (needs matplotlib) in --out.
"""

from __future__ import annotations
