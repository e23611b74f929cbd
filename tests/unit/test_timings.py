"""Every duration the library waits, polls or gives up after is named in its layer's timings module (issue 53).

elastic/_worker/timings.py, elastic/_agent/timings.py and elastic/_shared/timings.py hold them, each with its
reason, so that a reader sees a layer's clocks in one page; a module that uses one imports it under its own
name (tests patch it there). Read from the code (ast, not text): a module-level constant elsewhere in those
layers whose name says a duration and whose value is a number or a `timedelta(...)` fails, as does a
constant of a timings module with no comment or docstring, or a timings module that imports the library.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from support import REPO

LAYERS = ("_worker", "_agent", "_shared")
TIMINGS = {REPO / "elastic" / layer / "timings.py" for layer in LAYERS}
DURATION_NAME = re.compile(
    r"(?:^|_)(?:SECONDS|TIMEOUT|INTERVAL|DELAY|PERIOD|WAIT|DEADLINE|PAUSE|POLL|BACKOFF|STALE|SLACK|SLEEP|WINDOW"
    r"|GRACE|TTL|SKEW)S?(?:_|$)|_M?S(?:_|$)"
)
"""A name that says a duration: one of these words in it, or a unit (`_S`, `_MS`) as a word of it."""
NOT_DURATIONS = {
    ("elastic/_worker/integrity/numeric_guard.py", "WINDOW"): "good losses",
    ("elastic/_worker/integrity/numeric_guard.py", "MIN_WINDOW"): "good losses",
    ("elastic/_worker/integrity/check_interval.py", "WINDOW"): "steps",
    ("elastic/_worker/checkpoint/snapshot_interval.py", "WINDOW"): "steps and snapshots",
    ("elastic/_worker/control/step_vote.py", "_WINDOW"): "steps",
}
"""Counts whose name says a window: of steps or losses, not of time."""


def _is_duration_value(value: ast.expr | None) -> bool:
    """A number literal (signed, or arithmetic of literals) or a `timedelta(...)` call."""
    if isinstance(value, ast.Constant):
        return isinstance(value.value, (int, float)) and not isinstance(value.value, bool)
    if isinstance(value, ast.UnaryOp):
        return _is_duration_value(value.operand)
    if isinstance(value, ast.BinOp):
        return _is_duration_value(value.left) and _is_duration_value(value.right)
    if isinstance(value, ast.Call):
        func = value.func
        return (func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)) == "timedelta"
    return False


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements a module runs at import, into its top-level if/try/with blocks but not defs or classes."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from _module_level(getattr(node, field, []) or [])
        for handler in getattr(node, "handlers", []):
            yield from _module_level(handler.body)


def _constants(tree: ast.Module) -> Iterator[tuple[str, ast.stmt]]:
    """(name, statement) of each module-level assignment to a plain name."""
    for node in _module_level(tree.body):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Name):
                yield target.id, node


def durations(source: str) -> list[str]:
    """The module-level constants of `source` that are durations: such a name, such a value."""
    return [
        name for name, node in _constants(ast.parse(source))
        if DURATION_NAME.search(name) and _is_duration_value(node.value)  # type: ignore[attr-defined]
    ]


def layer_modules() -> list[Path]:
    return sorted(path for layer in LAYERS for path in (REPO / "elastic" / layer).rglob("*.py"))


def test_no_duration_is_defined_outside_the_timings_modules() -> None:
    strays = [
        f"{relative}: {name}"
        for path in layer_modules() if path not in TIMINGS
        for relative in [str(path.relative_to(REPO))]
        for name in durations(path.read_text())
        if (relative, name) not in NOT_DURATIONS
    ]
    assert strays == [], (
        "durations defined outside elastic/{_worker,_agent,_shared}/timings.py: move each to its layer's "
        f"timings module (with its reason) and import it under the same name: {strays}"
    )


def test_the_exceptions_are_still_there() -> None:
    """A count named like a window that was removed or renamed leaves no stale exception behind."""
    for relative, name in NOT_DURATIONS:
        assert name in dict(_constants(ast.parse((REPO / relative).read_text()))), f"{relative}: {name}"


def _commented_lines(source: str) -> set[int]:
    return {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT}


def test_every_timing_says_why() -> None:
    """Each constant of a timings module has a docstring after it, or a comment on its line or just above."""
    for path in sorted(TIMINGS):
        source = path.read_text()
        tree = ast.parse(source)
        comments = _commented_lines(source)
        names = []
        for index, node in enumerate(tree.body):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            names.append(node)
            after = tree.body[index + 1] if index + 1 < len(tree.body) else None
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(
                after.value.value, str)
            commented = node.lineno in comments or node.lineno - 1 in comments
            assert documented or commented, f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)} says no why"
        assert len(names) >= 5, path


def test_the_timings_modules_import_nothing_of_the_library() -> None:
    """Any module of the layer may import its timings module: that one imports only the standard library."""
    for path in sorted(TIMINGS):
        imported = [
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        ]
        assert not [name for name in imported if name and name.split(".")[0] == "elastic"], path


def test_the_finder_sees_durations_but_not_other_constants() -> None:
    source = (
        "FOO_SECONDS = 1.0\n_POLL_S = 0.005\nWAKE_TIMEOUT = timedelta(seconds=2)\nT: float = 2 * 60\n"
        "BACKOFF_MAX = -1\nX_MS = 5\nREAD_TIMEOUT = 60\n"
        "MIN_SECRET_BYTES = 16\nDEFAULT_EPHEMERAL_START = 32768\nSET_ASIDE_WINDOW_ENV = 'X'\n"
        "STALE_SUFFIX = '.old'\nWAITERS = 3\nMAX_SEQ = 1 << 62\n"
        "def f():\n    INNER_SECONDS = 1.0\n"
    )
    assert durations(source) == ["FOO_SECONDS", "_POLL_S", "WAKE_TIMEOUT", "BACKOFF_MAX", "X_MS", "READ_TIMEOUT"]
