"""Slurm's compact notations, expanded: host lists (`node[01-04,07]`) and task counts (`2(x3),1`).

Both arrive in environment variables a task did not write (SLURM_JOB_NODELIST,
SLURM_TASKS_PER_NODE), so both parsers check every character and refuse what
they do not understand with a `ValueError` naming the text, rather than
guessing a rank layout from it.

Invariants:
- `expand_hostlist` gives the hosts in Slurm's order, as `scontrol show hostnames` prints them:
  comma-separated items left to right, each item's bracket ranges in order, zero padding kept
  (`n[08-10]` is n08 n09 n10), several bracket groups in one item multiplied out, the last
  varying fastest (`r[1-2]n[1-2]` is r1n1 r1n2 r2n1 r2n2).
- Neither expands past `MAX_EXPANDED` entries: a corrupt variable cannot make a task allocate
  without bound.
"""

from __future__ import annotations

import itertools
import re

MAX_EXPANDED = 1 << 16
"""More hosts or tasks than any Slurm cluster runs in one job step."""

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")  # ASCII digits only, as Slurm reads them
_HOST_CHARS = re.compile(r"[A-Za-z0-9._-]*")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


def expand_hostlist(text: str) -> list[str]:
    """`node[01-04,07],login1` -> ['node01', 'node02', 'node03', 'node04', 'node07', 'login1']."""
    hosts: list[str] = []
    for item in _split_top_level(text):
        if not item:
            raise ValueError(f"host list {text!r} has an empty entry")
        hosts.extend(_expand_item(item, text))
        if len(hosts) > MAX_EXPANDED:
            raise ValueError(f"host list {text[:80]!r} expands to more than {MAX_EXPANDED} hosts")
    if not hosts:
        raise ValueError("host list is empty")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: tasks on each node of the step, in node order."""
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS.fullmatch(item)
        if match is None:
            raise ValueError(f"tasks per node {text!r}: {item!r} is not N or N(xR)")
        tasks, repeat = int(match.group(1)), int(match.group(2) or 1)
        if repeat < 1:
            raise ValueError(f"tasks per node {text!r}: a repeat count must be at least 1")
        if len(counts) + repeat > MAX_EXPANDED:
            raise ValueError(f"tasks per node {text[:80]!r} expands to more than {MAX_EXPANDED} nodes")
        counts.extend([tasks] * repeat)
    return counts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {text!r} nests brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r} closes a bracket it did not open")
        elif char == "," and depth == 0:
            items.append(text[start:index].strip())
            start = index + 1
    if depth != 0:
        raise ValueError(f"host list {text!r} leaves a bracket open")
    items.append(text[start:].strip())
    return items


def _expand_item(item: str, whole: str) -> list[str]:
    """One comma-free item: literal parts and bracket groups, multiplied out."""
    parts: list[list[str]] = []
    size, rest = 1, item
    while rest:
        open_at = rest.find("[")
        literal = rest if open_at < 0 else rest[:open_at]
        if not _HOST_CHARS.fullmatch(literal):
            raise ValueError(f"host list {whole!r}: {literal!r} is not a host name")
        parts.append([literal])
        if open_at < 0:
            break
        close_at = rest.index("]", open_at)
        group = _expand_ranges(rest[open_at + 1:close_at], whole)
        size *= len(group)
        if size > MAX_EXPANDED:  # checked per group: the groups themselves are never all held at once
            raise ValueError(f"host list {whole[:80]!r} expands to more than {MAX_EXPANDED} hosts")
        parts.append(group)
        rest = rest[close_at + 1:]
    return ["".join(combination) for combination in itertools.product(*parts)]


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    """`01-04,07` -> ['01', '02', '03', '04', '07']; the width of a range's first bound is kept."""
    names: list[str] = []
    for piece in ranges.split(","):
        match = _RANGE.fullmatch(piece)
        if match is None:
            raise ValueError(f"host list {whole!r}: [{ranges}] holds {piece!r}, not N or N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        low, high = int(first), int(last)
        if high < low:
            raise ValueError(f"host list {whole!r}: range {piece!r} runs backwards")
        if len(names) + high - low + 1 > MAX_EXPANDED:
            raise ValueError(f"host list {whole[:80]!r} expands to more than {MAX_EXPANDED} hosts")
        width = len(first)
        names.extend(str(number).zfill(width) for number in range(low, high + 1))
    return names
