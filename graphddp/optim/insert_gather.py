"""The forward-pass slot of ``sharding="optimizer", gather="forward"``: each sharded bucket's
all-gather completes in the next forward, right before its parameters are first read.

Why. With ``gather="backward"`` the last all-gathers are waited for at the end of the backward,
with nothing to hide behind; the next forward has compute of its own before it reads each bucket's
parameters (the DeAR pattern). The backward returns the all-gathers un-waited
(:mod:`graphddp.optim.insert_shard`); the runtime keeps them
(:class:`graphddp.runtime.gathers.PendingGathers`) for the forward of the same compiled graph::

    gather<b> = placeholder                       (after every existing input)
    ... the forward up to the first node reading a parameter of the bucket ...
    wait        wait_tensor(gather<b>)
    write       param_i.copy_(gather<b>[:, at_i:at_i + c_i].flat[:numel_i].view(shape_i))
    ... every later read of param_i reads the copy_ (data dependence: the write comes first) ...

Postcondition: :func:`verify_forward_gathers`.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphddp.graph.invariants import Memory
from graphddp.graph.trace import add_inputs, splice, trace
from graphddp.graph.verify.updates import check_writes
from graphddp.graph.verify_common import _fail
from graphddp.graph.bucket_function import gathered_value, write_fn
from graphddp.optim.shard_functions import ShardLayout
from graphddp.values.comm import BUCKET_KEY, ROLE_KEY, is_wait

GATHER_INPUT = "gather_input"  # ROLE_KEY of the forward's placeholder that receives a bucket's all-gather


def insert_forward_gathers(gm: fx.GraphModule, shards: Sequence[ShardLayout], param_index: Mapping[str, int]) -> None:
    """Per bucket of ``shards``: a new input for its all-gather (the caller passes them in ``shards``
    order after the graph's own), its wait and writes before the first read of its parameters."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(tuple(n.meta["val"] for n in placeholders if "val" in n.meta))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for shard in shards:
        b = shard.bucket
        params = [placeholders[param_index[n]] for n in b.param_names]
        value = gathered_value(b, shard.placement, fake_mode, params[0].meta["val"])
        (last,) = add_inputs(graph, [f"gather{b.index}"], [{"val": value, BUCKET_KEY: b.index, ROLE_KEY: GATHER_INPUT}])
        readers = [u for p in params for u in p.users]
        first = min(readers, key=order.__getitem__) if readers else graph.output_node()
        values = [last.meta["val"], *(p.meta["val"] for p in params)]
        write = trace(write_fn(b, shard.placement), values, f"forward gather of bucket {b.index}")
        written = splice(graph, write, [last, *params], first, b.index)
        for param, copy in zip(params, written):
            param.replace_all_uses_with(copy, delete_user_cb=lambda user, c=copy: user is not c)
    graph.lint()
    gm.recompile()


def verify_forward_gathers(gm: fx.GraphModule, shards: Sequence[ShardLayout]) -> None:
    """F2: each parameter's write is the placeholder's only reader, so no other read sees the old value.
    F1: each parameter of a bucket is written once, last, by a ``copy_`` depending on its bucket's wait
    (S5's check, after F2, which names a stale read more precisely)."""
    nodes = list(gm.graph.nodes)
    memory_of = Memory(nodes)
    inputs = {n.meta.get(BUCKET_KEY): n for n in nodes if n.op == "placeholder" and n.meta.get(ROLE_KEY) == GATHER_INPUT}
    copy_ = torch.ops.aten.copy_.default
    for shard in shards:
        b = shard.bucket
        where = f"forward gather of bucket {b.index}"
        source = inputs.get(b.index)
        if source is None:
            _fail(gm, gm.graph.output_node(), f"{where}: no all-gather input (F1)")
        waits = [u for u in source.users if is_wait(u)]
        writes = [n for n in nodes if n.meta.get(BUCKET_KEY) == b.index and n.meta.get(ROLE_KEY) == "write" and n.target is copy_]
        for write in writes:
            param = write.args[0]
            for user in param.users:
                if user is not write:
                    _fail(gm, user, f"{where}: {user.name} reads {param.name} itself, not through its write {write.name} (F2)")
        check_writes(gm, where, b.param_names, writes, waits, memory_of, rule="F1")
