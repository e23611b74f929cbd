"""docs/architecture.md stays true to the code: its picture to the import contracts and the tree, the
module table (docs/modules.md) to the files, and every name its flows mention to what the modules define."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib
from support import REPO

PAGE = REPO / "docs" / "architecture.md"
MODULES_PAGE = REPO / "docs" / "modules.md"
PACKAGE = REPO / "elastic"

WORKER_LAYERS = "worker side: each layer imports only the layers below it"
SHARED_LAYERS = "what both sides share: storage, Slurm and the agent-worker protocol above the common helpers"
AGENT_LAYERS = "agent side: the launcher above the rendezvous plug-ins"
SIDES = "the worker side and the agent side never import each other"
SHARED_BELOW = "what both sides share sits below both, and below the public modules and tools"
NO_TOOLS = "nothing in the library imports the tools"


def section(title: str, page: Path = PAGE) -> str:
    return page.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def contracts() -> dict[str, dict]:
    return {c["name"]: c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}


def layer_names(layer: str) -> set[str]:
    """import-linter's `a | b` (independent: neither imports the other) and `a : b` (may import each other) as the names on one row."""
    return set(layer.replace("|", ":").replace(":", " ").split())


def children(package: str) -> set[str]:
    """The modules and subpackages directly in `package` (a dotted name), by their short names."""
    folder = REPO.joinpath(*package.split("."))
    return {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").exists()
    }


@dataclass
class Picture:
    public: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)
    worker: str = ""
    agent: str = ""
    shared: str = ""
    worker_rows: list[set[str]] = field(default_factory=list)
    agent_rows: list[set[str]] = field(default_factory=list)
    shared_rows: list[set[str]] = field(default_factory=list)


def picture() -> Picture:
    """The ```text picture of "The layers": a header line per part, its names or its package after a
    colon; each side's rows indented below its header, the agent side's in the column its header starts."""
    text = re.search(r"```text\n(.*?)\n```", section("The layers"), re.S).group(1)  # type: ignore[union-attr]
    drawn = Picture()
    block = ""
    agent_column = 0
    for line in text.splitlines():
        if line.startswith("  "):
            if block == "sides":
                left, right = line[:agent_column].split(), line[agent_column:].split()
                if left:
                    drawn.worker_rows.append(set(left))
                if right:
                    drawn.agent_rows.append(set(right))
            elif block == "shared":
                drawn.shared_rows.append(set(line.split()))
            else:
                raise AssertionError(f"a row outside the sides and the shared part: {line!r}")
            continue
        head, _, names = line.partition(":")
        if head.startswith("public"):
            block, drawn.public = "public", names.split()
        elif head.startswith("tools"):
            block, drawn.tools = "tools", names.split()
        elif head.startswith("worker side"):
            block, agent_column = "sides", line.index("agent side:")
            drawn.worker = line[:agent_column].partition(":")[2].strip()
            drawn.agent = line[agent_column:].partition(":")[2].strip()
        elif head.startswith("shared below both"):
            block, drawn.shared = "shared", names.strip()
        else:
            raise AssertionError(f"a header the test does not know: {line!r}")
    return drawn


def test_the_picture_is_the_contracts() -> None:
    drawn = picture()
    rules = contracts()
    worker, shared, agent = rules[WORKER_LAYERS], rules[SHARED_LAYERS], rules[AGENT_LAYERS]
    assert worker["containers"] == [drawn.worker]
    assert drawn.worker_rows == [layer_names(layer) for layer in worker["layers"]]
    assert agent["containers"] == [drawn.agent]
    assert drawn.agent_rows == [layer_names(layer) for layer in agent["layers"]]
    for layer in [*worker["layers"], *shared["layers"], *agent["layers"]]:  # the page: names on one row never import each other
        assert ":" not in layer, f"{layer!r}: siblings on one row are independent, written a | b"
    assert shared["containers"] == [drawn.shared]
    assert drawn.shared_rows == [layer_names(layer) for layer in shared["layers"]]
    assert rules[SIDES]["type"] == "independence"
    assert set(rules[SIDES]["modules"]) == {drawn.worker, drawn.agent}
    below = rules[SHARED_BELOW]
    assert below["source_modules"] == [drawn.shared]
    assert set(below["forbidden_modules"]) == {drawn.worker, drawn.agent} | set(drawn.tools) | (set(drawn.public) - {"elastic"})
    no_tools = rules[NO_TOOLS]
    assert set(no_tools["source_modules"]) == {drawn.worker, drawn.agent, drawn.shared}
    assert set(no_tools["forbidden_modules"]) == set(drawn.tools)


def test_the_picture_is_the_tree() -> None:
    """Every part of elastic/ is drawn once, and every layer names what its package holds."""
    drawn = picture()
    top = {"elastic"} | {f"elastic.{name}" for name in children("elastic")}
    parts = [*drawn.public, *drawn.tools, drawn.worker, drawn.agent, drawn.shared]
    assert sorted(parts) == sorted(top)
    assert set().union(*drawn.worker_rows) == children(drawn.worker)
    assert set().union(*drawn.shared_rows) == children(drawn.shared)
    assert set().union(*drawn.agent_rows) == children(drawn.agent)


def module_rows() -> dict[str, set[str]]:
    """The module table's files (paths relative to elastic/) under each ### part of the section."""
    parts: dict[str, set[str]] = {}
    for chunk in section("Modules of `elastic/`", MODULES_PAGE).split("\n### ")[1:]:
        title, _, body = chunk.partition("\n")
        parts[title] = set(re.findall(r"^\| `([\w/]+\.py)` \|", body, re.M))
    return parts


def test_the_module_table_names_every_module() -> None:
    parts = module_rows()
    listed = [path for rows in parts.values() for path in rows]
    present = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    assert len(listed) == len(set(listed)), "a module listed twice"
    assert set(listed) == present


def test_the_module_table_follows_the_picture() -> None:
    """Each ### part of the table holds the files of the matching part of the picture."""
    drawn = picture()

    def top_name(path: str) -> str:
        first = path.split("/", 1)[0].removesuffix(".py")
        return "elastic" if first == "__init__" else f"elastic.{first}"

    expected = {
        "Public modules": set(drawn.public),
        "Tools": set(drawn.tools),
        f"Worker side: `{drawn.worker.removeprefix('elastic.')}/`": {drawn.worker},
        f"Agent side: `{drawn.agent.removeprefix('elastic.')}/`": {drawn.agent},
        f"Shared below both: `{drawn.shared.removeprefix('elastic.')}/`": {drawn.shared},
    }
    parts = module_rows()
    assert set(parts) == set(expected)
    for title, rows in parts.items():
        assert {top_name(path) for path in rows} <= expected[title], title


def test_every_name_in_the_flows_exists() -> None:
    text = section("How a save flows") + section("How a restore flows")
    names = set(re.findall(r"`(elastic(?:\.\w+)+)`", text))
    assert len(names) > 20
    missing = [name for name in sorted(names) if not _resolves(name)]
    assert missing == []


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or an attribute (class, function, method) of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False
