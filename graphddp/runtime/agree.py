"""Cross-rank agreement: every rank must put the same bytes on the wire, in the same order.

Compiling never talks: a rank may compile a graph no other rank compiles at that moment (a new
sequence length, a branch, a cache miss), and a collective issued then would pair with another
rank's bucket all-reduce: a hang, or a buffer reduced with the wrong one. Ranks agree in band, at
run time, in :func:`probe`: a fixed-size maximum over ranks of ``[h, -h, *flags]``, ``h`` a hash
of the wire layout (as with DDP, ranks whose compute differs but whose layout is equal reduce the
same gradients). Fixed-size, it never pairs with a bucket of another size, and every rank reads
the same answer.
"""
from __future__ import annotations

import contextlib
import hashlib
import pickle
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from graphddp.values.comm import gather_flat, group_name_of

# One bucket on the wire: (dtype, device type, wire dtype or None, user hook or None, bytes sent,
# ((param name, shape), ...)).
WireBucket = tuple[str, str, "str | None", "str | None", int, tuple[tuple[str, tuple[int, ...]], ...]]


class ScheduleMismatchError(RuntimeError):
    """Ranks would put different buckets on the wire; raised on every rank."""


class CollectiveError(RuntimeError):
    """A collective graphddp issued failed (dead peer, timeout); the cause is chained."""

    @classmethod
    def of(cls, what: str, cause: BaseException) -> CollectiveError:
        """The one wording of every such failure: what failed, and the backend's error."""
        return cls(
            f"graphddp: {what} failed ({type(cause).__name__}); a peer may have died or timed out. Original error: {cause}"
        )


def _is_fake(group: Any) -> bool:
    return dist.get_backend(group) == "fake"


def nothing_to_agree(group: Any) -> bool:
    """A group of one rank (or a fake one) agrees with itself: no collective is issued. (The GPU
    lane patches it to False to measure the agreement on one GPU, NCCL at world size 1.)"""
    return dist.get_world_size(group) == 1 or _is_fake(group)


_STAND_INS: set[str] = set()  # fake groups standing in for real ranks (standing_in)


@contextlib.contextmanager
def standing_in(group: Any) -> Iterator[None]:
    """While inside, the fake ``group`` is planned for as the real ranks it pretends to be
    (:func:`agrees_at_run_time`): ``graphddp.explain`` shows the plan a real run would make."""
    name = group_name_of(group)
    _STAND_INS.add(name)
    try:
        yield
    finally:
        _STAND_INS.discard(name)


def agrees_at_run_time(group: Any) -> bool:
    """More than one rank, and real ones (or a fake group :func:`standing_in` for them)?"""
    if dist.get_world_size(group) == 1:
        return False
    return not _is_fake(group) or group_name_of(group) in _STAND_INS


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """A stream of its own for an agreement's collective on a GPU: NCCL waits for the current stream,
    so on the compute stream the answer would wait for the whole queued forward, the GPU idle."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return torch.cuda.stream(stream)


def layout_hash(layout: Any) -> int:
    """A 60-bit hash of a layout (any value with a stable repr): fits an int64 and its negation."""
    return int(hashlib.sha256(repr(layout).encode()).hexdigest()[:15], 16)


def check_in_band(
    layout: tuple[int, tuple[WireBucket, ...]], group: Any, what: str, digest: int | None = None
) -> None:
    """Raise :class:`ScheduleMismatchError` on every rank, naming the first differing bucket,
    unless every rank passes an equal ``layout`` (``(world_size, buckets)``); on a difference every
    rank gathers, so the gather pairs with itself."""
    same, _ = probe(layout, (), group, what, digest)
    if not same:
        raise ScheduleMismatchError(describe_mismatch(_gather(layout, group), what))


def probe(
    layout: Any, flags: Sequence[bool], group: Any, what: str, digest: int | None = None
) -> tuple[bool, tuple[bool, ...]]:
    """Do all ranks pass an equal ``layout`` here, and which ``flags`` does any rank raise? The
    caller decides what a difference means."""
    return probe_async(layout, flags, group, what, digest).result()


class PendingProbe:
    """A :func:`probe` issued and not read yet (:func:`probe_async`): the host goes on, and
    :meth:`result` waits for the answer when something needs it. Read it exactly once."""

    def __init__(self, read: Callable[[], list[int]] | None, flags: Sequence[bool], what: str, question: Any = None) -> None:
        self._read, self._flags, self._what = read, tuple(bool(f) for f in flags), what
        self.question = question  # what the asker needs back with the answer (StepState: position, layout, shape)
        self._answer: tuple[bool, tuple[bool, ...]] | None = None

    def result(self) -> tuple[bool, tuple[bool, ...]]:
        """``(same, flags)`` as :func:`probe` returns them; waits for the collective once."""
        if self._answer is None:
            if self._read is None:  # nothing to agree (one rank, a fake group)
                self._answer = True, self._flags
            else:
                try:
                    values = self._read()
                except Exception as e:  # noqa: BLE001 - any backend failure, re-raised with context
                    raise _probe_failed(self._what, e) from e
                self._answer = values[0] == -values[1], tuple(v != 0 for v in values[2:])
        return self._answer


def probe_async(
    layout: Any, flags: Sequence[bool], group: Any, what: str, digest: int | None = None, question: Any = None
) -> PendingProbe:
    """:func:`probe`, issued now and read later: the same collective, so it pairs with any probe."""
    if nothing_to_agree(group):
        return PendingProbe(None, flags, what, question)
    h = layout_hash(layout) if digest is None else digest
    try:
        read = max_reduce_async([h, -h, *(int(bool(f)) for f in flags)], group)
    except Exception as e:  # noqa: BLE001 - any backend failure, re-raised with context
        raise _probe_failed(what, e) from e
    return PendingProbe(read, flags, what, question)


def _probe_failed(what: str, e: BaseException) -> CollectiveError:
    return CollectiveError.of(f"the agreement before the gradient all-reduces of {what}", e)


def max_reduce(values: Sequence[float], group: Any, dtype: torch.dtype = torch.int64) -> list:
    """Per position, the largest of every rank's ``values`` (sent as ``dtype``), read on the host.
    An all-gather and the maximum taken here, not a MAX all-reduce: for a few integers the
    all-reduce's two phases cost two small-message latencies where the all-gather costs one, and
    the host waits for it at every synchronising backward."""
    return max_reduce_async(values, group, dtype)()


def max_reduce_async(values: Sequence[float], group: Any, dtype: torch.dtype = torch.int64) -> Callable[[], list]:
    """:func:`max_reduce` issued now; the returned function waits for it and reads the answer."""
    device = _device(group)
    world = dist.get_world_size(group)
    with unset_fake_temporarily(), _side_stream(device):
        mine = torch.tensor(list(values), dtype=dtype, device=device)
        everyone = torch.empty(world * mine.numel(), dtype=dtype, device=device)
        work = gather_flat(everyone, mine, group, async_op=True)

    def read() -> list[int]:
        with unset_fake_temporarily(), _side_stream(device):
            work.wait()
            return everyone.view(world, -1).amax(dim=0).tolist()

    return read


def max_over_ranks(values: Sequence[float], group: Any, dtype: torch.dtype = torch.int64) -> list:
    """:func:`max_reduce`, or ``values`` where there is nothing to agree."""
    if nothing_to_agree(group) or not values:
        return list(values)
    return max_reduce(values, group, dtype)


def same_on_every_rank(values: Sequence[int], group: Any) -> bool:
    """Whether every rank passed these ``values``: one maximum over ranks of them and their
    negations (the largest equals the smallest); every rank calls it, whatever it holds."""
    got = max_over_ranks([*values, *(-v for v in values)], group)
    return got[: len(values)] == [-v for v in got[len(values):]] == list(values)


def any_rank(bits: Sequence[bool], group: Any) -> list[bool]:
    """Per position, whether any rank passes True."""
    return [v != 0 for v in max_over_ranks([int(bool(b)) for b in bits], group)]


def describe_mismatch(layouts: Sequence[tuple[int, tuple[WireBucket, ...]]], what: str) -> str:
    """Name the first bucket (and parameter) where some rank's layout differs from rank 0's."""
    base_world, base = layouts[0]
    other = next(r for r, lay in enumerate(layouts) if lay != layouts[0])
    world, theirs = layouts[other]
    head = f"graphddp: ranks would reduce different gradients in {what}: "
    tail = (
        ". graphddp buckets gradients in the order each backward graph produces them, so every "
        "rank must run graphs over the same parameters, produced in the same order (per-rank "
        "branches are fine when they use the same parameters in the same order), with the "
        "same graphddp options."
    )
    if world != base_world:
        return head + f"rank 0 has world size {base_world}, rank {other} has {world}" + tail
    k = next((i for i, (a, b) in enumerate(zip(base, theirs)) if a != b), min(len(base), len(theirs)))
    return head + f"first difference at bucket {k}: {_side(base, k, 0)}; {_side(theirs, k, other)}" + tail


def _side(buckets: tuple[WireBucket, ...], k: int, rank: int) -> str:
    if k >= len(buckets):
        return f"rank {rank} has no bucket {k} (it has {len(buckets)} buckets)"
    dtype, device, wire, hook, nbytes, params = buckets[k]
    listed = ", ".join(f"{name} {list(shape)}" for name, shape in params)
    wire_note = f", sent as {wire}" if wire else ""
    wire_note += f", through hook {hook} ({nbytes} bytes on the wire)" if hook else ""
    return f"rank {rank} sends {dtype} on {device}{wire_note}: [{listed}]"


def gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (small and picklable), in rank order, on every rank."""
    if nothing_to_agree(group):
        return [obj]
    return _gather(obj, group)


def _gather(obj: Any, group: Any) -> list[Any]:
    """Not ``dist.all_gather_object``, which needs NumPy; outside fake-tensor mode, as AOTAutograd
    may be tracing."""
    with unset_fake_temporarily():
        device = _device(group)
        data = pickle.dumps(obj)
        world = dist.get_world_size(group)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8, device=device)
        mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=group)
        return [pickle.loads(bytes(t[: int(n.item())].tolist())) for t, n in zip(everyone, sizes)]


def check_parameter_agreement(module: nn.Module, group: Any) -> None:
    """Raise on every rank if parameter names, shapes or dtypes differ between ranks: run before
    the initial broadcast, so a mismatch is an error, not a broadcast of the wrong size."""
    if nothing_to_agree(group):
        return
    mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()]
    digests = _gather(layout_hash(mine), group)
    if len(set(digests)) == 1:
        return
    everyone = _gather(mine, group)
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    a, b = everyone[0], everyone[other]
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    first = a[k] if k < len(a) else "nothing"
    second = b[k] if k < len(b) else "nothing"
    raise ValueError(
        f"graphddp.compile: ranks hold different parameters; parameter #{k} is {first} on rank 0 "
        f"but {second} on rank {other}. Every rank must build the same model."
    )
