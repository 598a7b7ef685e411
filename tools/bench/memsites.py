"""Where a CUDA process's allocated bytes come from: its live blocks grouped by allocation site.

Reads what ``torch.cuda.memory._snapshot()`` returns when ``_record_memory_history`` was on
(pure functions of that dict, so they run on CPU against a hand-made snapshot):

* :func:`live_sites`: the blocks allocated now (between steps, say), summed per site;
* :func:`peak_sites`: the blocks allocated at the highest point of a recorded stretch, from the
  blocks live when it started and the allocator's trace of allocations and frees since.

A block's *site* is the innermost frame of its allocation's Python stack that says something:
graphddp's own code, code inductor generated (with the generated line, which names the
buffer), or the first frame outside torch's internals. Blocks allocated before recording
started carry no stack and are reported as ``(before recording)``.
"""
from __future__ import annotations

import linecache
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

MB = 1024 * 1024
BEFORE = "(before recording)"
_TORCH_INTERNALS = ("/torch/", "/site-packages/", "<frozen", "/lib/python3")


def site_of(frames: Sequence[Mapping[str, Any]] | None) -> str:
    """The frame that names where a block was allocated (module docstring)."""
    if not frames:
        return BEFORE
    for frame in frames:
        name = str(frame.get("filename", ""))
        if "torchinductor" in name or "inductor_cache" in name or "/graphddp/" in name:
            line = linecache.getline(name, int(frame.get("line", 0))).strip() if "torchinductor" in name else ""
            where = f"{_short(name)}:{frame.get('line')} {frame.get('name')}"
            return f"{where}  {line[:90]}" if line else where
    for frame in frames:
        name = str(frame.get("filename", ""))
        if not any(part in name for part in _TORCH_INTERNALS):
            return f"{_short(name)}:{frame.get('line')} {frame.get('name')}"
    top = frames[0]
    return f"{_short(str(top.get('filename', '?')))}:{top.get('line')} {top.get('name')}"


def _short(path: str) -> str:
    for marker in ("/graphddp/", "/tools/", "/torch/", "/transformers/"):
        if marker in path:
            return marker.strip("/") + "/" + path.split(marker, 1)[1]
    return path.rsplit("/", 1)[-1]


def _blocks(snapshot: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    for segment in snapshot.get("segments", ()):
        yield from segment.get("blocks", ())


def live_blocks(snapshot: Mapping[str, Any]) -> dict[int, tuple[int, str]]:
    """address -> (bytes, site) of every block allocated in ``snapshot`` (a block freed but
    waiting on a stream's events still counts: ``memory_allocated`` counts it too)."""
    live = {}
    for block in _blocks(snapshot):
        if block.get("state") in ("active_allocated", "active_pending_free"):
            live[int(block["address"])] = (int(block["size"]), site_of(block.get("frames")))
    return live


def summarize(live: Mapping[int, tuple[int, str]], top: int = 12) -> list[tuple[str, float, int]]:
    """(site, MB, blocks) for the ``top`` sites by bytes, largest first, and one ``(other)`` row."""
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in live.values():
        per[site][0] += size
        per[site][1] += 1
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])
    out = [(site, size / MB, n) for site, (size, n) in rows[:top]]
    rest = rows[top:]
    if rest:
        out.append(("(other)", sum(v[0] for _, v in rest) / MB, sum(v[1] for _, v in rest)))
    return out


def live_sites(snapshot: Mapping[str, Any], top: int = 12) -> list[tuple[str, float, int]]:
    """:func:`summarize` of the blocks allocated in ``snapshot``."""
    return summarize(live_blocks(snapshot), top)


def peak_sites(
    before: Mapping[int, tuple[int, str]], trace: Sequence[Mapping[str, Any]], top: int = 12
) -> tuple[float, list[tuple[str, float, int]]]:
    """The highest point of ``trace`` (one device's events from ``_snapshot()["device_traces"]``,
    recorded from when ``before`` was live): its MB and :func:`summarize` of what was live then.

    An allocation counts from its ``alloc`` event; a free from ``free_completed`` (the allocator's
    own count of allocated bytes drops there, after any stream it was used on is done with it)."""
    live = dict(before)
    total = sum(size for size, _ in live.values())
    best, best_live = total, dict(live)
    for event in trace:
        action, addr = event.get("action"), int(event.get("addr", 0))
        if action == "alloc":
            live[addr] = (int(event["size"]), site_of(event.get("frames")))
            total += int(event["size"])
            if total > best:
                best, best_live = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    return best / MB, summarize(best_live, top)


def render(title: str, rows: Sequence[tuple[str, float, int]]) -> str:
    lines = [title] + [f"  {mb:9.1f} MB  {n:5d}  {site}" for site, mb, n in rows]
    return "\n".join(lines)
