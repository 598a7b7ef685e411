"""Full sharding (``sharding="full"``) against DDP + the same torch.optim.

Every case trains ``graphddp.compile(model, optimizer=opt, sharding="full")`` next to
``DistributedDataParallel`` and a plain optimizer of the same class, from parameters that differ
between the ranks before wrapping (rank 0's must win), with rank-dependent data, an LR scheduler
stepping every step and one ``no_sync`` micro-batch. After every step: the whole parameters
(``named_parameters()`` of the returned module gathers them) equal DDP's, the module holds only
its parts (``chunk(numel, world)`` elements each) and no gradient after ``zero_grad``, and
``graphddp.full_optimizer_state_dict`` equals the reference optimizer's ``state_dict()``.
World sizes 2 and 3 (3 cuts most parameters unevenly). Tolerances as in test_optim_ranks.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from matrix_models import _bert_batch, _hf_bert
from test_optim_ranks import ADAM_NOISE, CNN, TIGHT, _adamw, _cnn_loss, _gpt_loss, _hf_loss, _sgd, assert_state_dicts_equal, unequal_pair
from test_sharded import _mlp_loss, _mlp_loss_new_shape
from torch.nn.parallel import DistributedDataParallel as DDP

import graphddp
from graphddp import models
from graphddp.plan.parts import PREFETCH
from graphddp.runtime.agree import ScheduleMismatchError
from graphddp.testing import spawn
from graphddp.values.prediction import CostModel
from graphddp.values.comm import ROLE_KEY, is_wait
from graphddp.values.shards import chunk

GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
# On gloo a reduce-scatter travels as an all_to_all_single and a sum (half gloo's reduce_scatter's bytes).
ALL_TO_ALL = torch.ops._c10d_functional.all_to_all_single.default


def _bert_loss(m: nn.Module, rank: int, step: int) -> torch.Tensor:
    _, kwargs, _ = _bert_batch(rank, step, None)
    return m(**kwargs).loss


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, int, int], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    tol: dict = dataclasses.field(default_factory=lambda: TIGHT)
    steps: int = 4
    backend: str = "aot_eager"
    reshard: bool = True
    max_grad_norm: float | None = None
    cost: CostModel | None = None  # the buckets' cap planned from this model (None: calibrated)
    form: str = "compile"  # or "backend_object", "backend_name": torch.compile(model, backend=graphddp.backend(...) or "graphddp")


# A link so slow for its per-collective cost that the planned cap is the floor (0.25 MB), so the
# wide GPT-2 below travels in several buckets, more than are issued ahead at once.
SLOW_LINK = CostModel(bandwidth_gbps=0.01, latency_us=0.0, collective_overhead_us=1.0)


def _hf_gpt2_wide() -> nn.Module:  # 1.8 MB of fp32 parameters
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=512, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class _EagerHead(nn.Module):
    """An MLP whose last layer runs outside every compiled graph: its parameters are read, gathered
    and reduce-scattered eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.body = models.MLP(d_out=8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _eager_head(self, self.body(x))


@torch._dynamo.disable
def _eager_head(model: _EagerHead, h: torch.Tensor) -> torch.Tensor:
    return model.head(torch.relu(h))


CASES = {
    "mlp_adamw": Case(models.MLP, _mlp_loss, _adamw),
    "mlp_adamw_kept_to_the_backward": Case(models.MLP, _mlp_loss, _adamw, reshard=False),
    "mlp_sgd_nesterov_clipped": Case(models.MLP, _mlp_loss, _sgd, max_grad_norm=0.05),
    "frozen_mlp_adamw": Case(models.FrozenMLP, _mlp_loss, _adamw),
    "cnn_adamw": Case(CNN, _cnn_loss, _adamw),
    "eager_head_adamw": Case(_EagerHead, _mlp_loss, _adamw),
    "tied_across_break_sgd": Case(lambda: models.BreakGPT(vocab=64, dim=32, heads=2, layers=2, seq=8), _gpt_loss, _sgd),
    # GPT-2 with AdamW updating its parts inside: test_hybrid.py's full_hf_gpt2_adamw_2x2 (a shard
    # group of 2, this file's parts); GPT-2 in this file: hf_gpt2_sgd_planned_buckets.
    "hf_bert_adamw": Case(_hf_bert, _bert_loss, _adamw, tol=ADAM_NOISE, steps=3),
    # SGD: AdamW turns the attention key bias's gradient, rounding noise whose sum order the
    # buckets change, into steps of about lr (1.2e-4 apart from DDP's on this model)
    "hf_gpt2_sgd_planned_buckets": Case(_hf_gpt2_wide, _hf_loss, _sgd, steps=3, cost=SLOW_LINK),
    "mlp_adamw_recompile": Case(models.MLP, _mlp_loss_new_shape, _adamw),
    "mlp_adamw_inductor": Case(models.MLP, _mlp_loss, _adamw, backend="inductor", steps=3),
    "mlp_adamw_backend_object": Case(models.MLP, _mlp_loss, _adamw, form="backend_object"),
    "mlp_sgd_backend_name": Case(models.MLP, _mlp_loss, _sgd, form="backend_name"),
}


class _Pipeline:
    """``torch.compile(model, backend=graphddp.backend(model, sharding="full", ...))`` seen as the
    module ``graphddp.compile`` returns: called, switched, its parameters read whole (through
    ``model.state_dict()``, which gathers), inspected on the backend object."""

    def __init__(self, model: nn.Module, compiled: Any, made: Any) -> None:
        self.model, self.compiled, self.made = model, compiled, made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # no_sync, parts, graphs, updates, schedules
        return getattr(self.__dict__["made"], name)

    def named_parameters(self) -> Any:
        return ((n, v) for n, v in self.model.state_dict().items() if n in self.made.parts)

    def state_dict(self) -> dict:
        return self.model.state_dict()


def _pair(case: Case, rank: int) -> tuple[Any, nn.Module, torch.optim.Optimizer, DDP, torch.optim.Optimizer]:
    mine, ref = unequal_pair(case.make, rank)
    opt, ref_opt = case.optimizer(mine), case.optimizer(ref.module)
    options = dict(
        optimizer=opt, sharding="full", backend=case.backend, reshard_after_forward=case.reshard,
        max_grad_norm=case.max_grad_norm, cost=case.cost,
    )
    if case.form == "compile":
        return graphddp.compile(mine, **options), mine, opt, ref, ref_opt
    made = graphddp.backend(mine, **options)
    compiled = torch.compile(mine, backend=made if case.form == "backend_object" else "graphddp")
    return _Pipeline(mine, compiled, made), mine, opt, ref, ref_opt


def _step(case: Case, ours: Any, opt: Any, sched: Any, ref: DDP, ref_opt: Any, ref_sched: Any, rank: int, step: int) -> None:
    if step == 2:  # a no_sync micro-batch first, accumulated into the synchronising one
        with ours.no_sync():
            case.loss(ours, rank, 50 + step).backward()
        with ref.no_sync():
            case.loss(ref, rank, 50 + step).backward()
    case.loss(ours, rank, step).backward()
    case.loss(ref, rank, step).backward()
    if case.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), case.max_grad_norm)
    for o, s in ((opt, sched), (ref_opt, ref_sched)):
        o.step()
        s.step()
        o.zero_grad()


def _check(case: Case, name: str, ours: Any, mine: nn.Module, ref: DDP, ref_opt: Any, world: int, step: int) -> None:
    whole = dict(ours.named_parameters())
    for n, q in ref.module.named_parameters():
        torch.testing.assert_close(whole[n], q.detach(), **case.tol, msg=lambda m: f"{name} step {step} param {n}: {m}")
    for n, p in mine.named_parameters():
        assert p.dim() == 1 and p.numel() == chunk(ours.parts[n].numel, world), f"{name}: {n} is held as {tuple(p.shape)}, not its part"
        assert p.grad is None, f"{name} step {step}: {n}.grad kept after zero_grad"
    assert_state_dicts_equal(graphddp.full_optimizer_state_dict(ours), ref_opt.state_dict(), case.tol, f"{name} step {step}")
    ref_buffers = dict(ref.module.named_buffers())  # this rank's: broadcast before the forwards DDP broadcasts before
    for n, b in mine.named_buffers():
        torch.testing.assert_close(b, ref_buffers[n], **case.tol, msg=lambda m: f"{name} step {step} buffer {n}: {m}")


def _train(rank: int, world: int, name: str) -> None:
    case = CASES[name]
    ours, mine, opt, ref, ref_opt = _pair(case, rank)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    for step in range(case.steps):
        _step(case, ours, opt, sched, ref, ref_opt, ref_sched, rank, step)
        _check(case, name, ours, mine, ref, ref_opt, world, step)
    assert ours.state_dict().keys() == ref.module.state_dict().keys()
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(v, ref.module.state_dict()[k], **case.tol, msg=lambda m: f"{name} state_dict[{k!r}]: {m}")
    _check_updates_inside(case, name, ours)
    _check_planned_cap(case, name, ours)
    backwards = [g for kind, g in ours.graphs if kind == "backward"]
    assert backwards, f"{name}: no backward graph compiled"
    ops = [n.target for g in backwards for n in g.graph.nodes]
    assert ALL_TO_ALL in ops, f"{name}: no gradient was reduce-scattered in a compiled backward"
    assert REDUCE_SCATTER not in ops, f"{name}: gloo's reduce_scatter was issued"


def _check_planned_cap(case: Case, name: str, ours: Any) -> None:
    """Every graph's buckets closed at the cap planned from the model's cost (the given one, or the
    calibrated one); with ``case.cost``, in more buckets than travel at once."""
    graphs = [g for s in ours.schedules for g in s.graphs]
    assert graphs and all(g.cap is not None and g.cap.source.startswith("planned (") for g in graphs), name
    if case.cost is not None:
        assert all(g.cap.source == "planned (given)" for g in graphs), [g.cap for g in graphs]
        most = max(len(g.of("gather")) for g in graphs)
        assert most > PREFETCH + 1, f"{name}: {most} gather bucket(s) in a graph: the gathers ahead were not exercised"


def _check_updates_inside(case: Case, name: str, ours: Any) -> None:
    """Where the backward updated the parts itself, and where it left them to opt.step(), and
    why (graphddp.compiler.full_updates): every step inside, step 2's synchronising micro-step
    adding what its no_sync micro-step accumulated (carried); with max_grad_norm never; a weight
    tied across a graph break: both graphs leave their parts to opt.step() (the second graph's
    backward, run first, because the first is still to come; the first because the second
    returned the tied weight's share)."""
    counts = ours.updates
    if case.max_grad_norm is not None:
        assert counts == {}, f"{name}: max_grad_norm steps after the backward, yet {counts}"
    elif "across_break" in name:
        assert counts == {"shared": 2 * case.steps, "no_sync": 2}, f"{name}: {counts}"
    else:
        assert counts.get("inside", 0) >= case.steps - 1, f"{name}: {counts}"
        assert counts.get("no_sync") and counts.get("inside, carried"), f"{name}: {counts}"
        assert not set(counts) - {"inside", "inside, carried", "no_sync"}, f"{name}: {counts}"


@pytest.mark.parametrize("name", list(CASES))
def test_full_sharding_matches_ddp_on_two_ranks(name: str) -> None:
    spawn(_train, 2, name)


# uneven parts of every parameter, a tied weight across a graph break (HF GPT-2: on two ranks)
@pytest.mark.parametrize("name", ["cnn_adamw", "tied_across_break_sgd"])
def test_full_sharding_matches_ddp_on_three_ranks(name: str) -> None:
    spawn(_train, 3, name)


# -- where the gathers are ------------------------------------------------------------------------


def _placement(rank: int, world: int, reshard: bool, out: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 33), nn.ReLU(), nn.Linear(33, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a bucket closes at 512 B: the last weight (660 B) is a bucket of its own
    ours = graphddp.compile(model, optimizer=opt, sharding="full", backend="aot_eager", reshard_after_forward=reshard,
                            bucket_cap_mb=512 / 2**20)
    ours(torch.randn(4, 7)).square().mean().backward()
    (fw_kind, forward), (bw_kind, backward), (update_kind, _) = ours.graphs
    assert (fw_kind, bw_kind, update_kind) == ("forward", "backward", "backward_update")
    gathers = lambda g: [n for n in g.graph.nodes if n.meta.get(ROLE_KEY) == "gather" and n.target in (GATHER, ALL_TO_ALL)]  # noqa: E731
    scatters = [n for n in backward.graph.nodes if n.meta.get(ROLE_KEY) == "reduce_scatter" and n.target is ALL_TO_ALL]
    assert len(gathers(forward)) == 4, "the forward gathers the 6 parts in 4 buckets: w0 | b0 w1 | b1 w2 | b2"
    assert all(n.target is ALL_TO_ALL for n in gathers(forward)), "gloo: a gather is an all-to-all"
    assert scatters, "gloo: a reduce-scatter is an all-to-all"
    gathered = {n for n in forward.graph.nodes if is_wait(n)}
    saved = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    from_gather = {a.meta["val"].numel() for a in saved if isinstance(a, torch.fx.Node) and _reaches(a, gathered)}
    if reshard:
        # the backward reads the last weight first: the forward keeps it (one bucket's cap), and the
        # backward gathers again the middle one (the first's gradient reads no weight: the input needs none)
        assert from_gather == {33 * 5}, f"the forward saves gathered values for the backward: {from_gather}"
        assert len(gathers(backward)) == 1, "the backward gathers again what it reads"
    else:
        assert from_gather == {33 * 5, 33 * 33}, "kept to the backward: the forward saves the gathered weights"
        assert not gathers(backward)


def _reaches(node: torch.fx.Node, gathered: set, depth: int = 8) -> bool:
    """Is ``node`` a gathered parameter or a view of one (a few steps back)?"""
    if node in gathered or any(a in gathered for a in node.all_input_nodes):
        return True
    return depth > 0 and len(node.all_input_nodes) == 1 and _reaches(node.all_input_nodes[0], gathered, depth - 1)


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_places_the_gathers(reshard: bool) -> None:
    spawn(_placement, 2, reshard, {})


# -- checkpoints across world sizes ---------------------------------------------------------------


# AdamW's state recut from halves to thirds (HF GPT-2's whole-tensor state dict, tied weights
# included: _train)
CHECKPOINTED = "mlp_adamw"


def _save_two(rank: int, world: int, path: str) -> None:
    case = CASES[CHECKPOINTED]
    ours, mine, opt, ref, ref_opt = _pair(case, rank)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    for step in range(2):
        _step(case, ours, opt, sched, ref, ref_opt, ref_sched, rank, step)
    model_state, opt_state = ours.state_dict(), graphddp.full_optimizer_state_dict(ours)  # every rank gathers
    plain = case.optimizer(copy.deepcopy(ref.module))
    plain.load_state_dict(opt_state)  # loads into a plain torch.optim of the same class
    if rank == 0:
        torch.save({"model": model_state, "opt": opt_state, "ref_model": ref.module.state_dict(), "ref_opt": ref_opt.state_dict()}, path)


def _resume_three(rank: int, world: int, path: str) -> None:
    case = CASES[CHECKPOINTED]
    saved = torch.load(path)
    ours, mine, opt, ref, ref_opt = _pair(case, rank)
    ours.load_state_dict(saved["model"])
    graphddp.load_full_optimizer_state_dict(ours, saved["opt"])
    ref.module.load_state_dict(saved["ref_model"])
    ref_opt.load_state_dict(saved["ref_opt"])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    _check(case, "resumed", ours, mine, ref, ref_opt, world, 2)
    for step in range(3, 5):
        _step(case, ours, opt, sched, ref, ref_opt, ref_sched, rank, step)
        _check(case, "resumed on 3 ranks", ours, mine, ref, ref_opt, world, step)


def test_a_checkpoint_written_on_two_ranks_resumes_on_three(tmp_path) -> None:
    path = os.path.join(tmp_path, "ckpt.pt")
    spawn(_save_two, 2, path)
    spawn(_resume_three, 3, path)


# -- every rank runs every forward ----------------------------------------------------------------


def _evaluate_on_rank_zero(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = models.TinyGPT(vocab=64, dim=32, heads=2, layers=2, seq=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ours = graphddp.compile(model, optimizer=opt, sharding="full", backend="aot_eager")
    x = torch.randint(0, 64, (2, 16))

    def train() -> None:
        ours(x).float().mean().backward()
        opt.step()
        opt.zero_grad()

    train()
    with torch.no_grad():  # every rank evaluates: the same forward everywhere
        ours.eval()
        ours(x)
        ours.train()
    train()
    # nanoGPT's estimate_loss, on rank 0 alone: its gathers would pair with rank 1's next forward
    with pytest.raises(ScheduleMismatchError, match=r"rank 0: its forward 4, under no_grad; rank 1: its forward 4, with autograd"):
        if rank == 0:
            with torch.no_grad():
                ours(x)
        train()


def test_a_forward_on_one_rank_alone_is_an_error_on_every_rank() -> None:
    spawn(_evaluate_on_rank_zero, 2)


class _TwoHeads(nn.Module):
    """Two heads of one shape; the forward's ``second`` picks one (Dynamo compiles a graph per value)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, second: bool) -> torch.Tensor:
        return (self.b if second else self.a)(torch.relu(self.body(x)))


def _heads_by_rank(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = graphddp.compile(model, optimizer=opt, sharding="full", backend="aot_eager")

    def train(second: bool, batch: int = 4) -> None:
        ours(torch.randn(batch, 8), second).square().mean().backward()
        opt.step()
        opt.zero_grad()

    train(False)
    train(False, batch=4 + rank)  # another batch size on rank 1 (its own recompile): the same gathers, no error
    train(True)  # every rank the other head: the same gathers again
    train(rank == 1)  # rank 1's head is not rank 0's: its parts were gathered with rank 0's other head ...
    with pytest.raises(ScheduleMismatchError, match=r"different compiled graphs in their forward 4, graph call 1: "
                       r"rank 0's gathers .*'a\.weight'.*, rank 1's gathers .*'b\.weight'"):
        train(False)  # ... found before the next forward's first gather, on every rank


def test_graphs_that_gather_other_parameters_on_other_ranks_are_an_error_on_every_rank() -> None:
    spawn(_heads_by_rank, 2)
