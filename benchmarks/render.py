"""The docs' figures, rendered from the benchmarks' result files: nobody types a measured figure.

    python benchmarks/render.py           # rewrite every rendered block of README.md and docs/*.md
    python benchmarks/render.py --check   # exit 1, naming the block, when one differs from its rendering

A rendered block in a markdown file is

    <!-- figures: VIEW -->
    ...what `VIEW` renders (a table, its provenance line)...
    <!-- /figures -->

VIEW names a function of `benchmarks/views.py` (registered with `@view("name")`) that takes the
result files (benchmarks/results/NAME.json, written by each benchmark's `--json`: benchmarks/provenance.py)
and returns markdown. Re-measuring a figure is running its benchmark with `--json
benchmarks/results/NAME.json` and then this script; tests/unit/test_rendered_figures.py fails when
a block is not its rendering, or when a measured figure stands outside a block.

Invariants: a file is rewritten only when one of its blocks changed, atomically; text outside the
blocks is never touched; a block naming an unknown view, or a view whose result file is missing,
is an error naming the file and line, never an empty block.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
if __name__ == "__main__":  # run as a script: views.py's `from render import view` must register here, not in a copy
    sys.modules.setdefault("render", sys.modules[__name__])
from common import write_atomically  # noqa: E402
from provenance import read_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCUMENTS = ("README.md", "docs")
BLOCK = re.compile(r"(<!-- figures: (?P<view>[\w./-]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)

Results = Mapping[str, dict[str, Any]]
"""Result files by benchmark file name (without .json), each as `provenance.read_result` returns it."""
View = Callable[[Results], str]
_VIEWS: dict[str, View] = {}


class RenderError(Exception):
    """A block that cannot be rendered: unknown view, missing result file, malformed block."""


def view(name: str) -> Callable[[View], View]:
    """Register a function that renders the block `<!-- figures: name -->`."""

    def register(function: View) -> View:
        if name in _VIEWS:
            raise ValueError(f"view {name!r} is registered twice")
        _VIEWS[name] = function
        return function

    return register


def views() -> dict[str, View]:
    import views as _views  # noqa: F401 - registers the project's views

    return dict(_VIEWS)


class LazyResults(Mapping[str, dict[str, Any]]):
    """The result files of `directory`, each read on first use; a missing one is a `RenderError`."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._read: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self._read:
            path = self._directory / f"{name}.json"
            if not path.is_file():
                raise RenderError(f"no result file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}: "
                                  f"run its benchmark with --json {path.name}")
            try:
                self._read[name] = read_result(path)
            except ValueError as error:
                raise RenderError(str(error)) from None
        return self._read[name]

    def __iter__(self) -> Iterator[str]:
        return (path.stem for path in sorted(self._directory.glob("*.json")))

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    view: str
    body: str


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in BLOCK.finditer(text):
        found.append(Block(path, text.count("\n", 0, match.start()) + 1, match["view"], match["body"]))
    opened = text.count("<!-- figures:")
    if opened != len(found):
        raise RenderError(f"{path}: {opened} '<!-- figures: VIEW -->' openings but {len(found)} closed blocks")
    return found


def render_text(text: str, where: Path, known: Mapping[str, View], results: Results) -> str:
    """`text` with every block's body replaced by its view's rendering."""

    def rendered(match: re.Match[str]) -> str:
        name = match["view"]
        line = text.count("\n", 0, match.start()) + 1
        if name not in known:
            raise RenderError(f"{where}:{line}: no view named {name!r} (benchmarks/views.py)")
        try:
            body = known[name](results).rstrip("\n") + "\n"
        except RenderError as error:
            raise RenderError(f"{where}:{line}: {error}") from None
        return f"{match.group(1)}{body}{match.group(4)}"

    return BLOCK.sub(rendered, text)


def documents(root: Path = REPO) -> list[Path]:
    found = []
    for name in DOCUMENTS:
        path = root / name
        found += sorted(path.rglob("*.md")) if path.is_dir() else [path] if path.is_file() else []
    return [path for path in found if "<!-- figures:" in path.read_text()]


def stale(paths: list[Path], known: Mapping[str, View], results: Results) -> list[tuple[Path, str]]:
    """(path, its rendered text) for every file one of whose blocks is not its rendering."""
    changed = []
    for path in paths:
        text = path.read_text()
        new = render_text(text, path, known, results)
        if new != text:
            changed.append((path, new))
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is not its rendering")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the result files' folder")
    args = parser.parse_args(argv)
    try:
        changed = stale(documents(), views(), LazyResults(args.results))
    except RenderError as error:
        print(f"render.py: error: {error}", file=sys.stderr)
        return 2
    for path, text in changed:
        where = path.relative_to(REPO)
        if args.check:
            print(f"render.py: {where}: a rendered block differs from its result file; run python benchmarks/render.py")
        else:
            write_atomically(path, text)
            print(f"render.py: rendered {where}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
