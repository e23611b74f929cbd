"""The layer checks are live: a forbidden import or a cycle added to a copy of the package breaks them.

Each check runs in a process of its own, over a copy of elastic/ with one
function-level import added (tests/unit/test_layers.py runs them on the real tree).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from support import REPO

PACKAGE = REPO / "elastic"


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the `elastic` package in `root`, with the repository's contracts."""
    code = (
        "import sys\nfrom importlinter.cli import lint_imports\n"
        f"sys.exit(lint_imports(config_filename={str(REPO / 'pyproject.toml')!r}, no_cache=True, no_logo=True))"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})


def cycles(root: Path) -> list[list[str]]:
    """tests/unit/test_layers.cycles over the `elastic` package in `root`."""
    code = "import json\nfrom test_layers import cycles\nprint(json.dumps(cycles()))"
    path = os.pathsep.join([str(root), str(REPO / "tests" / "unit"), str(REPO / "tests")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def copy_with(tmp_path: Path, additions: dict[str, str]) -> Path:
    """elastic/ copied under `tmp_path`, with a function importing `additions[module file]` added to each file."""
    shutil.copytree(PACKAGE, tmp_path / "elastic", ignore=shutil.ignore_patterns("__pycache__"))
    for relative, statement in additions.items():
        path = tmp_path / "elastic" / relative
        path.write_text(path.read_text() + f"\n\ndef _late():\n    {statement}  # noqa: F401\n")
    return tmp_path


def test_the_unchanged_copy_passes(tmp_path: Path) -> None:
    root = copy_with(tmp_path, {})
    assert lint(root).returncode == 0
    assert cycles(root) == []


def test_a_forbidden_import_on_the_save_path_is_caught(tmp_path: Path) -> None:
    root = copy_with(tmp_path, {
        "_worker/runtime/context.py": "from elastic._agent.launcher import keeper",
        "_worker/checkpoint/saver.py": "import elastic.chaos",
    })
    done = lint(root)
    assert done.returncode != 0
    assert "the worker side and the agent side never import each other BROKEN" in done.stdout
    assert "nothing in the library imports the tools BROKEN" in done.stdout


def test_a_cycle_is_caught(tmp_path: Path) -> None:
    root = copy_with(tmp_path, {"_worker/observe/events.py": "from elastic._worker.run.run import Run"})
    assert lint(root).returncode != 0
    assert any("elastic._worker.run.run" in group and "elastic._worker.observe.events" in group for group in cycles(root))
