"""The optimizer inside the backward against DDP + the same torch.optim, on 2 gloo ranks.

Every case trains graphddp (``optimizer=`` attached, parameters updated inside the backward)
next to ``DistributedDataParallel`` + a plain optimizer of the same class, from parameters
that differ between the ranks before wrapping (graphddp and DDP both broadcast rank 0's), with
rank-dependent data, an LR scheduler stepping every step, and one step made of a ``no_sync``
micro-batch followed by a synchronising one. After every step: the parameters equal DDP's,
every ``p.grad`` is None, and ``opt.state`` matches the reference optimizer's.

Tolerances: the in-graph math is torch's, op for op, but compiled code rounds differently
(an FMA here and there), so results agree to float32 rounding, not bit for bit. Adam turns
rounding noise into full-size steps on parameters whose true gradient is zero (GPT-2's
attention key bias): those cases compare with a looser tolerance, said where it is used.
"""
from __future__ import annotations

import copy
import dataclasses
import io
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

# A GPT whose tied embedding is read on both sides of a graph break.
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.testing import spawn, update_runs

TIGHT = {"atol": 2e-6, "rtol": 1e-5}
ADAM_NOISE = {"atol": 1e-4, "rtol": 1e-3}  # Adam on zero-gradient parameters (module docstring)
# fp16 on the wire: gradients 1 ulp of half precision apart, which Adam's normalised step
# passes on at up to lr * 2^-10 relative per step.
FP16_ADAM = {"atol": 2e-4, "rtol": 2e-3}


class CNN(nn.Module):
    """Conv -> BatchNorm -> ReLU twice and a linear head. The convolutions have no bias, as in
    ResNets: a bias before BatchNorm has a zero gradient, which Adam turns into steps of noise."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.flatten(1))


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _tokens(rank: int, step: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _gpt_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = _tokens(rank, step)
    return F.cross_entropy(m(x).flatten(0, 1), x.flatten())


def _hf_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = _tokens(rank, step)
    return m(x, labels=x).loss


def _cnn_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    return F.cross_entropy(m(x), y)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)


def _amsgrad_groups(model: nn.Module) -> torch.optim.Optimizer:
    """Adam (coupled weight decay, amsgrad) with two param groups: biases without decay."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.Adam([{"params": decay, "weight_decay": 0.05}, {"params": rest, "lr": 3e-3}],
                            lr=1e-2, amsgrad=True)


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    backend: str = "aot_eager"
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    steps: int = 4
    no_sync_step: int = 2  # this step accumulates one micro-batch locally first
    round_trip: bool = False  # checkpoint the optimizer into plain torch.optim and back
    # Per graph with buckets: (steps updated inside the graph, steps left to torch's step).
    # The step after no_sync carries the accumulated gradients into the buckets and updates in
    # the graph too; with a parameter tied across a graph break it cannot: it averages them
    # eagerly and updates after the backward.
    expect_runs: tuple = ((4, 0),)
    form: str = "compile"  # or "backend": torch.compile(model, backend=graphddp.backend(model, ...))
    fp16_compress: bool = False  # comm_hook="fp16_compress" here, DDP's fp16_compress_hook there
    tied: tuple[str, ...] = ()  # parameters read on both sides of a graph break (records show them)


CASES = {
    "cnn_adamw": Case(CNN, _cnn_loss, _adamw),
    "cnn_adam_amsgrad_groups_backend_form": Case(CNN, _cnn_loss, _amsgrad_groups, form="backend"),
    "cnn_adamw_fp16_compress": Case(CNN, _cnn_loss, _adamw, tol=FP16_ADAM, fp16_compress=True),
    "tied_across_break_sgd_nesterov": Case(lambda: models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8), _gpt_loss, _sgd,
                                           expect_runs=((3, 1), (3, 1)), tied=("tok.weight",)),  # after, in both
    "hf_gpt2_adamw_round_trip": Case(_hf_gpt2, _hf_loss, _adamw, tol=ADAM_NOISE, round_trip=True),
    # The update inside the backward under inductor against DDP: test_recompile's inductor row
    # (AdamW in the graph across a recompile), test_sharded's and test_sharded_forward's
    # mlp_adamw_inductor, test_memory_held's inductor modes (a TinyGPT case here cost the
    # suite's cold run about a minute of C++ compiles for kernels no other test has).
}


def _by_graph(ours: Any) -> list[Any]:
    """Schedules in graph order (``ours.schedules`` is in backward-compile order)."""
    return sorted(ours.schedules, key=lambda s: s.graph_index)


def _assert_state_equal(ours: torch.optim.Optimizer, ref: torch.optim.Optimizer, tol: dict, what: str) -> None:
    assert_state_dicts_equal(ours.state_dict(), ref.state_dict(), tol, what)


def assert_state_dicts_equal(a: dict, b: dict, tol: dict, what: str) -> None:
    """Two optimizer state dicts: the same param groups, state keys and values (within ``tol``)."""
    assert a["param_groups"] == b["param_groups"], what
    assert a["state"].keys() == b["state"].keys(), f"{what}: state of parameters {sorted(a['state'])} vs {sorted(b['state'])}"
    for i, st in a["state"].items():
        assert st.keys() == b["state"][i].keys(), f"{what}: parameter {i} state {sorted(st)} vs {sorted(b['state'][i])}"
        for k, v in st.items():
            torch.testing.assert_close(v, b["state"][i][k], **tol, msg=lambda m: f"{what}: state[{i}][{k!r}]: {m}")


def step_beside_ddp(ours: Any, model: Any, opt: Any, ref: DDP, ref_opt: Any, loss: Callable, rank: int, step: int,
                    max_grad_norm: float | None = None) -> None:
    """One training step of graphddp (``ours`` the object with ``no_sync``, ``model`` what is
    called) and of DDP beside it with ``clip_grad_norm_`` where graphddp clips; step 1 starts
    with a ``no_sync`` micro-batch on both, which the next backward carries into its buckets."""
    if step == 1:
        with ours.no_sync():
            loss(model, rank, 50 + step).backward()
        with ref.no_sync():
            loss(ref, rank, 50 + step).backward()
    loss(model, rank, step).backward()
    opt.step()
    opt.zero_grad()
    loss(ref, rank, step).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
    ref_opt.step()
    ref_opt.zero_grad()


def unequal_pair(make: Callable[[], nn.Module], rank: int) -> tuple[nn.Module, DDP]:
    """A model from ``make`` (seeded) for graphddp, unequal on rank 1 before wrapping (graphddp
    must broadcast rank 0's parameters, as DDP does), and DDP around a copy of it."""
    torch.manual_seed(0)
    base = make()
    mine = copy.deepcopy(base)
    if rank == 1:
        with torch.no_grad():
            for p in mine.parameters():
                p.add_(0.25)
    return mine, DDP(copy.deepcopy(base))


def start_unequal(case: Any, rank: int) -> tuple[nn.Module, DDP, torch.optim.Optimizer, torch.optim.Optimizer]:
    """``case``'s model for graphddp and DDP's (:func:`unequal_pair`, DDP's with its fp16 hook
    where the case compresses), and an optimizer of the case's class for each."""
    mine, ref = unequal_pair(case.make, rank)
    if case.fp16_compress:
        ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return mine, ref, case.optimizer(mine), case.optimizer(ref.module)


def step_both(case: Any, view: Any, ours: Any, mine: tuple[Any, Any], ref: DDP, theirs: tuple[Any, Any], rank: int, step: int) -> None:
    """One training step on each side: at ``case.no_sync_step`` a ``no_sync`` micro-batch first,
    then a synchronising one; the optimizer and LR scheduler of each stepped as users step them
    (graphddp's attached ``step``/``zero_grad`` are no-ops)."""
    if step == case.no_sync_step:
        with view.no_sync():
            case.loss(ours, rank, 50 + step).backward()
        with ref.no_sync():
            case.loss(ref, rank, 50 + step).backward()
        assert any(p.grad is not None for p in view._state.module.parameters()), "no_sync kept no gradient"
    for model, (opt, sched) in ((ours, mine), (ref, theirs)):
        case.loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    ours_model, ref, opt, ref_opt = start_unequal(case, rank)
    options = dict(optimizer=opt, backend=case.backend, bucket_cap_mb=0.004, comm_hook="fp16_compress" if case.fp16_compress else None)
    if case.form == "backend":
        view = graphddp.backend(ours_model, **options)  # schedules, no_sync() and the replica, as below
        ours = torch.compile(ours_model, backend=view)
    else:
        ours = view = graphddp.compile(ours_model, **options)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)  # created after: the order
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
        for step in range(case.steps):
            step_both(case, view, ours, (opt, sched), ref, (ref_opt, ref_sched), rank, step)
            for (n, p), q in zip(ours_model.named_parameters(), ref.module.parameters()):
                assert p.grad is None, f"step {step}: {n}.grad kept after a synchronising backward"
                torch.testing.assert_close(p.detach(), q.detach(), **case.tol, msg=lambda m: f"{name} step {step} param {n}: {m}")
            _assert_state_equal(opt, ref_opt, case.tol, f"{name} step {step}")
        updated = sum(len(b.updates) for s in view.schedules for b in s.buckets)
        assert updated > 0, f"{name}: no parameter was updated inside a graph"
        # Which variant each graph ran: inside the graph, except where it cannot be the whole step.
        runs = tuple(r for r, sched in zip(update_runs(view), _by_graph(view)) if sched.buckets)
        assert runs == case.expect_runs, f"{name}: (in-graph, after-backward) steps per graph {runs}, expected {case.expect_runs}"
    told = [str(w.message) for w in warned if "torch's step" in str(w.message)]
    assert all(any(n in t for t in told) for n in case.tied) and (told == []) == (case.tied == ()), told
    shared = {n for r in view.records for n in r.fallbacks.get("shared", ())}
    assert shared == set(case.tied), f"{name}: records show {sorted(shared)} left to torch's step as shared, expected {case.tied}"
    if case.round_trip:
        _round_trip(ours, opt, ref, ref_opt, case, rank)


def _round_trip(ours: Any, opt: torch.optim.Optimizer, ref: DDP, ref_opt: torch.optim.Optimizer, case: Case, rank: int) -> None:
    """graphddp's optimizer checkpoint resumes plain torch.optim, and plain torch.optim's resumes graphddp."""
    buf = io.BytesIO()
    torch.save({"model": ours.module.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    plain_model = copy.deepcopy(ref.module)
    plain_model.load_state_dict(saved["model"])
    plain_opt = case.optimizer(plain_model)
    plain_opt.load_state_dict(saved["opt"])  # graphddp -> plain torch.optim
    _assert_state_equal(plain_opt, ref_opt, case.tol, "plain optimizer loaded from graphddp's state_dict")
    # plain torch.optim -> graphddp (attached still); a copy, as from a file (a live state_dict
    # shares its tensors with the optimizer it came from)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    ours.load_state_dict(ref.module.state_dict())
    step = case.steps
    case.loss(ours, rank, step).backward()
    case.loss(ref, rank, step).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    for (n, p), q in zip(ours.module.named_parameters(), ref.module.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **case.tol, msg=lambda m: f"after resuming from DDP's optimizer state: {n}: {m}")
    _assert_state_equal(opt, ref_opt, case.tol, "after resuming from DDP's optimizer state")


@pytest.mark.parametrize("name", list(CASES))
def test_optimizer_in_backward_matches_ddp(name: str) -> None:
    spawn(_train, 2, name)
