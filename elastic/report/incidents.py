"""The job's incidents, read back from its event log: named hangs, failures, nodes set aside, a crash loop.

torchrevive-run's agents write these events (elastic._agent.launcher.job_watch): `hang` (the culprit
ranks, their nodes, hosts and stack tops, the collective), `failure` (rank, node, host, exit status or
signal, step, first error line, and whether it was a peer's failure reaching the worker), `node_excluded`
(node, host, reason, failures) and `crash_loop` (step, rank, node, error). `describe` gives one line each,
for `python -m elastic.report`; `set_aside` the nodes set aside and why.

Invariant: a field of the wrong type (a log edited or torn by hand) is shown as "?", never an exception.
"""

from __future__ import annotations

from typing import Any

KINDS = ("hang", "failure", "node_excluded", "crash_loop")


def _text(value: Any) -> str:
    return value if isinstance(value, str) and value else "?"


def _number(value: Any) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def _items(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def describe(event: dict[str, Any]) -> str | None:
    """One line for an incident event; None for another kind."""
    kind, step = event.get("event"), _number(event.get("step"))
    if kind == "hang":
        culprits = _items(event.get("culprits"))
        nodes, tops = _items(event.get("nodes")), _items(event.get("stack_tops"))
        named = ", ".join(
            f"rank {_number(rank)} on node {_text(nodes[i] if i < len(nodes) else None)}"
            f" (stack top {_text(tops[i] if i < len(tops) else None)})"
            for i, rank in enumerate(culprits)
        ) or "no culprit named"
        return f"hang at step {step} in {_text(event.get('collective'))}: {named}"
    if kind == "failure":
        reached = "" if event.get("primary") is not False else " (a peer's failure reached it)"
        return (f"failure at step {step}: rank {_number(event.get('rank'))} on node {_text(event.get('node'))} "
                f"(host {_text(event.get('host'))}), exit {_number(event.get('exitcode'))}: "
                f"{_text(event.get('error'))}{reached}")
    if kind == "node_excluded":
        return (f"node set aside at step {step}: {_text(event.get('node'))} (host {_text(event.get('host'))}) after "
                f"{_number(event.get('failures'))} failures: {_text(event.get('reason'))}")
    if kind == "crash_loop":
        return (f"crash loop stopped the job after step {step}: rank {_number(event.get('rank'))} on node "
                f"{_text(event.get('node'))}, {_text(event.get('error'))}")
    return None


def incidents(events: list[dict[str, Any]]) -> list[str]:
    """One line per incident event, in order."""
    return [line for line in map(describe, events) if line is not None]


def set_aside(events: list[dict[str, Any]]) -> dict[str, str]:
    """The nodes set aside, each with its reason."""
    return {_text(e.get("node")): _text(e.get("reason")) for e in events if e.get("event") == "node_excluded"}
