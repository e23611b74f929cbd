"""The views of the docs' rendered blocks (benchmarks/render.py): result files in, markdown out.

Each view is registered with `@view("name")` and is named by a block `<!-- figures: name -->` in
README.md or docs/*.md. A view formats what its benchmark measured and ends with the provenance
line of every result file it read (`measured`), so a reader sees how to measure it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from render import Results, view  # noqa: F401 - `view` registers the views below


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; None cells read "-"."""
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def seconds(value: float | None, digits: int = 2) -> str | None:
    return None if value is None else f"{value:.{digits}f} s"


def ratio(value: float | None, digits: int = 3) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def percent(value: float | None, digits: int = 2) -> str | None:
    return None if value is None else f"{100 * value:.{digits}f} %"


def measured(*documents: dict[str, Any]) -> str:
    """One line per result file: the command, commit, torch, machine and date it was measured with."""
    lines = []
    for document in documents:
        made = document["provenance"]
        machine = made.get("machine") or {}
        commit = (made.get("commit") or "unknown")[:10] + (" (uncommitted changes)" if made.get("dirty") else "")
        lines.append(
            f"*Measured by `{made.get('command', '?')}` at commit {commit}, torch {made.get('torch')}, "
            f"{machine.get('cores')} cores ({machine.get('cpu')}), {made.get('date', '?')[:10]}.*"
        )
    return "\n".join(lines) + "\n"
