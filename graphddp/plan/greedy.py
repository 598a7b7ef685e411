"""The greedy rule every mode's buckets follow, in a module of its own so that every planner calls one function."""
from __future__ import annotations

from typing import Callable, Hashable, Iterable, TypeVar

Item = TypeVar("Item")


def bucket_by_size(
    items: Iterable[Item], key: Callable[[Item], Hashable], nbytes: Callable[[Item], int], limit: Callable[[int], int],
    consecutive: bool = False,
) -> list[list[Item]]:
    """As inductor's ``greedy_bucket_collective_by_mb``, parameterised by a key and a size: walk ``items``
    in order, add each to the open bucket of its ``key``, and close that bucket once its bytes reach
    ``limit(n)``, ``n`` the buckets of that key closed before it (``>=``, as DDP's reducer does: a bucket
    passes its limit by at most its last item, and an item larger than the limit is a bucket alone).
    DDP keeps one bucket open per key across interleaved keys; with ``consecutive`` a key change closes
    the open bucket, so every bucket is a run of consecutive items (full sharding: one collective
    replaces a bucket's members where the graph has them). Returns the buckets in the order they
    closed, those left open at the end last, in the order they opened."""
    opened: dict[Hashable, list[Item]] = {}
    sizes: dict[Hashable, int] = {}
    closed: dict[Hashable, int] = {}
    done: list[list[Item]] = []
    for item in items:
        k = key(item)
        if consecutive and opened and k not in opened:
            done.extend(opened.values())
            opened.clear()
        if k not in opened:
            opened[k], sizes[k] = [], 0
        opened[k].append(item)
        sizes[k] += nbytes(item)
        if sizes[k] >= limit(closed.get(k, 0)):
            done.append(opened.pop(k))
            closed[k] = closed.get(k, 0) + 1
    done.extend(opened.values())
    return done
