"""Every name the project's code uses is defined (pyflakes' undefined-name check, no lint beyond it).

Why: two merges left a NameError on paths no other unit test runs (launch.py called a helper another
branch had moved, `_max_nodes`; the etcd-v3 creator lost its `key`); both surfaced only when a job started."""

from __future__ import annotations

from pathlib import Path

from pyflakes import api, messages, reporter

REPO = Path(__file__).resolve().parents[2]
TREES = ("elastic", "benchmarks", "recipes", "tests")


class _Collect(reporter.Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message: messages.Message) -> None:
        if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
            self.found.append(f"{message.filename}:{message.lineno}: {message.message % message.message_args}")

    def syntaxError(self, filename: str, msg: str, lineno: int, offset: int, text: str) -> None:  # noqa: N802
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename: str, msg: str) -> None:  # noqa: N802
        self.found.append(f"{filename}: {msg}")


def test_no_module_uses_a_name_it_never_defines() -> None:
    collected = _Collect()
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            api.checkPath(str(path), collected)
    assert not collected.found, "\n".join(collected.found)
