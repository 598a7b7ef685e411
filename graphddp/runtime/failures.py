"""Name the bucket whose collective failed inside a compiled backward graph.

A collective that fails (a dead peer, a timeout) raises from inside generated code, naming
neither graphddp nor the bucket. The compiled code issues the buckets' all-reduces in bucket
order, so the innermost traceback frame on an ``all_reduce_`` or ``wait_tensor`` line, and which
all-reduce of that source file it is, name the bucket.
"""
from __future__ import annotations

import linecache
import re
from types import TracebackType

from graphddp.runtime.agree import CollectiveError
from graphddp.values.collectives import WAIT_PATTERN, issue_pattern
from graphddp.values.schedule import Schedule

_ISSUE = re.compile(r"(?:(\w+)\s*=\s*)?torch\.ops\." + issue_pattern().pattern)  # the issue of any bucket collective kind
_WAIT = re.compile(r"torch\.ops\." + WAIT_PATTERN.pattern)


def _collective_frame(tb: TracebackType | None) -> tuple[str, int] | None:
    """(file, line) of the innermost frame executing a collective line, if any."""
    found = None
    while tb is not None:
        filename, lineno = tb.tb_frame.f_code.co_filename, tb.tb_lineno
        line = linecache.getline(filename, lineno)
        if _ISSUE.search(line) or _WAIT.search(line):
            found = (filename, lineno)
        tb = tb.tb_next
    return found


def _bucket_of_line(filename: str, lineno: int) -> tuple[int, str] | None:
    """(ordinal of the all-reduce, 'issue' or 'wait') for a collective line of ``filename``."""
    ordinal_of: dict[str, int] = {}
    count = 0
    for number, line in enumerate(linecache.getlines(filename), start=1):
        if m := _ISSUE.search(line):
            for name in m.groups():
                if name:
                    ordinal_of[name] = count
            if number == lineno:
                return count, "issue"
            count += 1
        elif number == lineno and (m := _WAIT.search(line)):
            ordinal = ordinal_of.get(m.group(1))
            return (ordinal, "wait") if ordinal is not None else None
    return None


def collective_failure(error: BaseException, schedule: Schedule) -> CollectiveError | None:
    """A :class:`CollectiveError` naming the graph and bucket, or None if ``error`` did not
    come from one of the graph's collectives (then it is re-raised unchanged)."""
    frame = _collective_frame(error.__traceback__)
    if frame is None:
        return None
    located = _bucket_of_line(*frame)
    where = f"backward graph {schedule.graph_index}"
    if located is None or located[0] >= schedule.num_buckets:
        what = "a gradient all-reduce"
    else:
        index, phase = located
        bucket = schedule.buckets[index]
        names = ", ".join(bucket.param_names[:4]) + (", ..." if len(bucket.slots) > 4 else "")
        verb = "issuing" if phase == "issue" else "waiting for"
        what = f"{verb} the {bucket.collective.replace('_', '-')} of bucket {index} ({bucket.nbytes} bytes: {names})"
    return CollectiveError.of(f"{what} in {where}", error)
