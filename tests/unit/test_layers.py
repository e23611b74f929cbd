"""The architecture as tests: layers, sides, no cycles, small modules (tests/integration/test_layer_checks.py
shows the checks catch a forbidden import and a cycle).

The contracts live in pyproject.toml ([tool.importlinter]) and are drawn in
docs/architecture.md. import-linter reads every import statement, function-level
ones included (they load the module all the same); so does the cycle count here.
"""

from __future__ import annotations

import grimp
import pytest
import tomllib
from importlinter import configuration
from importlinter.application.use_cases import lint_imports
from support import REPO

PACKAGE = REPO / "elastic"
MAX_LINES = 400
HEADROOM = 10
"""A module stays under MAX_LINES by design, not by trimming: none sits within HEADROOM lines of it (issue 53)."""
TOOLING = {"chaos"}
"""Top-level parts of elastic/ outside every contract's source lists: tooling that imports anything."""


def contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def cycles() -> list[list[str]]:
    """The import cycles of the `elastic` this process imports (strongly connected groups of
    modules), function-level imports included."""
    graph = grimp.build_graph("elastic", include_external_packages=False, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    return [group for group in _strongly_connected(edges) if len(group) > 1]


def _strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is small, but recursion depth is not guaranteed)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges.get(root, [])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, []))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(sorted(group))
    return groups


def test_the_layer_contracts_hold(capsys: pytest.CaptureFixture[str]) -> None:
    # The use case itself, not import-linter's CLI function: that one reconfigures logging for the
    # whole process (dictConfig disables every logger made so far).
    configuration.configure()
    kept = lint_imports(config_filename=str(REPO / "pyproject.toml"), cache_dir=None, no_logo=True)
    report = capsys.readouterr().out
    assert kept, report
    assert f"Contracts: {len(contracts())} kept, 0 broken." in report


def test_there_are_no_import_cycles() -> None:
    assert cycles() == []


def test_every_part_of_the_package_is_in_a_contract() -> None:
    """A new module cannot slip past the layers: each top-level module or package of elastic/
    is named in some contract (or is the tooling on top, which may import anything)."""
    named: set[str] = set()
    for contract in contracts():
        for key in ("source_modules", "forbidden_modules"):
            named.update(m.split(".")[1] for m in contract.get(key, []) if m.count(".") >= 1)
        for layer in contract.get("layers", []):
            named.update(part.strip() for part in layer.replace("|", ":").split(":"))
    parts = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }
    assert parts - named - TOOLING == set()


def test_no_module_is_near_400_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES - HEADROOM
    }
    assert long == {}
