"""One public surface: `elastic` and `elastic.hf` export every name a script needs, and the recipes
and the docs' code use nothing else (everything else is internal: elastic._worker, _agent, _shared)."""

from __future__ import annotations

import ast
import importlib
import re

import pytest
from support import REPO

import elastic

PUBLIC_MODULES = {"elastic", "elastic.hf"}
# The top of the package: the front doors, the tools that run as programs, and the internal packages.
TOP_LEVEL = {"__init__.py", "hf.py", "checkpoint.py", "report", "chaos", "_worker", "_agent", "_shared"}


def internal_uses(source: str) -> list[str]:
    """Every import of, or attribute reached through, a name outside the public surface."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "elastic":
            if node.module not in PUBLIC_MODULES:
                found.append(f"from {node.module} import ...")
            else:
                public = set(importlib.import_module(node.module).__all__) | ({"hf"} if node.module == "elastic" else set())
                found += [f"from {node.module} import {a.name}" for a in node.names if a.name not in public]
        elif isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "elastic" and a.name not in PUBLIC_MODULES]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "elastic":
            if node.attr not in set(elastic.__all__) | {"hf"}:
                found.append(f"elastic.{node.attr}")
    return found


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.S)


def test_every_exported_name_resolves_and_the_front_door_declares_them() -> None:
    import elastic.hf

    for module in (elastic, elastic.hf):
        assert module.__all__, module.__name__
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"
    with pytest.raises(AttributeError):
        elastic.CheckpointManager  # noqa: B018  (internal: not at the front door)


def test_the_checker_catches_an_internal_import() -> None:
    assert internal_uses("from elastic._worker.run.run import Run\n") == ["from elastic._worker.run.run import ..."]
    assert internal_uses("import elastic._shared.common.cli\n") == ["import elastic._shared.common.cli"]
    assert internal_uses("import elastic\nelastic.runtime.barrier()\n") == ["elastic.runtime"]
    assert internal_uses("from elastic import Run, read_checkpoint\nfrom elastic.hf import Trainer\n") == []


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.py")))
def test_recipes_import_only_public_names(recipe: str) -> None:
    assert internal_uses((REPO / "recipes" / recipe).read_text()) == []


def test_the_docs_code_imports_only_public_names() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = [(page.name, block) for page in pages for block in python_blocks(page.read_text())]
    assert blocks
    found = {}
    for name, block in blocks:
        try:
            uses = internal_uses(block)
        except SyntaxError:  # an excerpt with "..." lines: its import lines alone
            uses = internal_uses("\n".join(line for line in block.splitlines() if line.startswith(("import ", "from "))))
        if uses:
            found.setdefault(name, []).extend(uses)
    assert found == {}


def test_the_package_top_shows_the_layers() -> None:
    entries = {p.name for p in (REPO / "elastic").iterdir() if p.name != "__pycache__"}
    assert entries == TOP_LEVEL
    assert len(entries) <= 12
