"""The whole optimizer state of both sharded modes (:mod:`graphddp.optim.whole_state`) on one rank
of a fake group of four: what each mode's part of a state keeps, and a loaded state's checks, all
made before the optimizer changes. Its gathers run on real ranks (tests/ranks/test_sharded.py,
test_full_sharding.py, test_sharded_resume.py, test_hybrid.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphddp.optim.whole_state import WholeState
from graphddp.testing import init_fake_process_group, release_process_group

SHAPES = ((2, 5), (2,))  # 10 elements: chunks of 3, rank 3 holds 1 and 2 zeros; 2 elements: ranks 2 and 3 own none


@pytest.fixture
def rank_of_four():
    yield lambda rank: init_fake_process_group(4, rank)
    release_process_group()


def _adam(numel: int) -> dict:
    """Adam's whole state of a parameter of ``numel`` elements."""
    return {"step": torch.tensor(3.0), "exp_avg": torch.arange(float(numel)), "exp_avg_sq": torch.ones(numel)}


@pytest.mark.parametrize("rank", [0, 3])
def test_each_mode_keeps_its_part_of_a_whole_state(rank_of_four, rank: int) -> None:
    rank_of_four(rank)
    full, optimizer = (WholeState(("weight", "bias"), SHAPES, dist.group.WORLD, padded) for padded in (True, False))
    state = _adam(10)
    padded, unpadded = full.cut(0, state), optimizer.cut(0, state)
    assert padded["exp_avg"].tolist() == ([0.0, 1.0, 2.0] if rank == 0 else [9.0, 0.0, 0.0])
    assert unpadded["exp_avg"].tolist() == ([0.0, 1.0, 2.0] if rank == 0 else [9.0])
    assert padded["step"] == 3 and padded["step"] is not state["step"]  # the whole parameter's count, a copy
    assert full.cut(1, _adam(2))["exp_avg_sq"].tolist() == [1.0 if rank == 0 else 0.0]  # rank 3: padding only
    assert (optimizer.cut(1, _adam(2)) is None) == (rank == 3)  # no element: no state


def test_a_loaded_state_is_checked_before_the_optimizer_changes(rank_of_four) -> None:
    rank_of_four(0)
    model = torch.nn.Linear(5, 2)
    opt = torch.optim.Adam(model.parameters())
    whole = WholeState(("weight", "bias"), SHAPES, dist.group.WORLD, padded=False)
    plain = {"state": {0: _adam(10), 1: _adam(2)}, "param_groups": opt.state_dict()["param_groups"]}
    refused = {
        "a different number of param groups": {**plain, "param_groups": plain["param_groups"] * 2},
        "a param group holds a different number of parameters": {**plain, "param_groups": [{**plain["param_groups"][0], "params": [0]}]},
        r"entries for 3 parameters \(indices up to 2\), the optimizer steps 2": {**plain, "state": {**plain["state"], 2: _adam(2)}},
        "'exp_avg' of 'bias' has 1 elements, the parameter 2: .* holds one rank's part": {**plain, "state": {1: whole.cut(1, _adam(2))}},
    }
    for message, state in refused.items():
        with pytest.raises(ValueError, match=message):
            whole.load(opt, state)
        assert not opt.state, message
    whole.load(opt, {**plain, "state": {str(i): s for i, s in plain["state"].items()}})  # indices as JSON writes them
    assert opt.state[model.weight]["exp_avg"].tolist() == [0.0, 1.0, 2.0] and opt.state[model.bias]["exp_avg"].tolist() == [0.0]
