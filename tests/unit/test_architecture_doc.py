"""docs/architecture.md stays true to the code: its picture to the import contracts, its module table
to the files, and every name its flows mention to what the modules define."""

from __future__ import annotations

import importlib
import re

import tomllib
from support import REPO

PAGE = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "elastic"


def section(title: str) -> str:
    return PAGE.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def picture() -> list[str]:
    return re.search(r"```text\n(.*?)\n```", section("The layers"), re.S).group(1).splitlines()  # type: ignore[union-attr]


def contracts() -> dict[str, dict]:
    return {c["name"]: c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}


def short(modules: list[str]) -> set[str]:
    return {m.removeprefix("elastic.") for m in modules}


def test_the_picture_is_the_contracts() -> None:
    lines = picture()
    worker_rows = [line for line in lines[1:] if line.startswith("  ")]
    worker, agent = [], []
    for row in worker_rows:
        left, _, right = row.strip().partition("   ")
        worker.append(set(left.split()))
        agent += right.split()
    layers = contracts()["worker side: each layer imports only the layers below it"]["layers"]
    assert worker == [set(layer.replace("|", ":").replace(":", " ").split()) for layer in layers]
    assert set(agent) == short(contracts()["the agent side never imports the worker side"]["source_modules"])
    shared = next(line for line in lines if line.startswith("shared below both:")).split(":", 1)[1].split()
    assert set(shared) == short(contracts()["what both sides share sits below both"]["source_modules"])
    tooling = next(line for line in lines if line.startswith("tooling on top")).split(":", 1)[1].split()
    everything = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()
    }
    assert set(tooling) == everything - set().union(*worker) - set(agent) - set(shared)


def test_the_module_table_names_every_module() -> None:
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", section("Modules of `elastic/`"), re.M))
    present = {
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent == PACKAGE
    }
    assert listed == present


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
