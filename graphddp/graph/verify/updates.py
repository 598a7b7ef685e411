"""The update of each part of a sharded placement (S5 for ``sharding="optimizer"``, P4 for
``sharding="full"``): written once, last, from its average (invariants' G, L, A)."""
from __future__ import annotations

from typing import Mapping

import torch
import torch.fx as fx

from graphddp.graph.invariants import Memory, from_average, not_returned, root, written_last
from graphddp.graph.part_facts import UPDATE_PARAM, input_name
from graphddp.graph.verify_common import VerificationError, _fail
from graphddp.values.comm import ROLE_KEY, is_wait
from graphddp.values.part_schedule import REDUCE_WAITS


def check_writes(gm: fx.GraphModule, where: str, names: tuple[str, ...], writes: list[fx.Node], gather_waits: list[fx.Node],
                  memory_of: Memory, rule: str = "S5") -> None:
    """S5 for one bucket, or ``rule`` F1 for its all-gather completed in the next forward."""
    if len(writes) != len(names):
        _fail(gm, (writes or [gm.graph.output_node()])[0], f"{where}: {len(writes)} parameter writes for {len(names)} parameters ({rule})")
    for write in writes:
        from_average(gm, write, gather_waits, rule, f"{where}: a parameter's write", "the all-gather")
        written_last(gm, [write], memory_of, rule, f"{where}: {root(write.args[0], memory_of).name}")


def check_part_updates(gm: fx.GraphModule, updated: Mapping[int, str]) -> None:
    """P4 for ``updated``: backward output index -> part name, every part the graph updates."""
    nodes = list(gm.graph.nodes)
    outs = gm.graph.output_node().args[0]
    inputs = {n.name: n for n in nodes if n.op == "placeholder"}
    extra = [n for n in nodes if n.op == "placeholder" and n.name.startswith(UPDATE_PARAM)]
    if len(extra) != len(updated):
        raise VerificationError(f"graphddp verify: P4: {len(updated)} parts updated, {len(extra)} update_param inputs")
    writes: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        if node.target is torch.ops.aten.copy_.default and node.meta.get(ROLE_KEY) == "update":
            writes.setdefault(node.args[0], []).append(node)  # the update writes its input itself
    memory = Memory(nodes)
    reduce_waits = [n for n in nodes if is_wait(n) and n.meta.get(ROLE_KEY) in REDUCE_WAITS]
    for k, (index, name) in enumerate(sorted(updated.items())):
        what = f"P4: the update of part {name!r} (output {index})"
        not_returned(gm, outs[index], "P4", what)
        targets = [t for t in (inputs.get(input_name(index)), extra[k]) if t is not None]
        write = written_last(gm, [w for t in targets for w in writes.get(t, [])], memory, "P4", what, aliases=targets)
        from_average(gm, write, reduce_waits, "P4", what, "a reduce")
