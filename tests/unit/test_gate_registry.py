"""A gated graph's all-reduces name its gate's group (graphddp.runtime.gate), so that name must
resolve to the gate: registered once per group, and again when the name stops resolving to it."""
from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import _unregister_process_group
from torch.distributed.distributed_c10d import _resolve_process_group

from graphddp.runtime.gate import gate_for
from graphddp.values.comm import gate_name, group_name_of


def test_the_gate_is_registered_once_and_again_when_its_name_no_longer_resolves(fake_world):
    fake_world(4)
    group = dist.group.WORLD
    name = gate_name(group_name_of(group))
    gate = gate_for(group)
    assert _resolve_process_group(name) is gate and gate.inner is group
    assert gate_for(group) is gate
    _unregister_process_group(name)
    again = gate_for(group)
    assert _resolve_process_group(name) is again
