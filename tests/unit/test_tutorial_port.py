"""The port of a DDP script to the runtime is small, and the README shows it as it is.

recipes/tutorial_ddp.py is the classic DDP tutorial as people write it (epochs, an evaluation at the end
of each, a DistributedSampler, a DataLoader with workers); recipes/tutorial.py is its fault-tolerant port.
recipes/tutorial_config_ddp.py and tutorial_config.py are the same as a config-file script (hydra's
shape: `main(cfg)` on a mapping). The port of each writes at most 10 lines (a line is compared without its
indentation, the `with` block's, and without its `# elastic` mark, which every line of the port carries);
it also deletes what the runtime does instead (the sampler's epoch, the checkpoint, the group's setup and
teardown, their imports).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest
from support import REPO

RECIPES = REPO / "recipes"
PAIRS = [("tutorial_ddp.py", "tutorial.py"), ("tutorial_config_ddp.py", "tutorial_config.py")]
MARK = re.compile(r"\s+# elastic\b.*$")


def code(path: Path) -> list[str]:
    """The lines after the module docstring, as written."""
    return path.read_text().split('"""', 2)[2].splitlines()


def compared(line: str) -> str:
    return MARK.sub("", line).strip()


def changes(plain: list[str], port: list[str]) -> tuple[list[str], list[str]]:
    """(the lines the port writes, the lines it deletes), blank lines aside."""
    a = [compared(line) for line in plain if compared(line)]
    b = [line for line in port if compared(line)]
    matcher = difflib.SequenceMatcher(a=a, b=[compared(line) for line in b], autojunk=False)
    added, deleted = [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            deleted += a[i1:i2]
            added += b[j1:j2]
    return added, deleted


@pytest.mark.parametrize(("plain", "port"), PAIRS)
def test_the_port_writes_at_most_ten_lines_each_marked(plain: str, port: str) -> None:
    added, deleted = changes(code(RECIPES / plain), code(RECIPES / port))
    assert len(added) <= 10, "\n".join(added)
    assert all(MARK.search(line) for line in added), [line for line in added if not MARK.search(line)]
    assert len(deleted) <= 16, "\n".join(deleted)  # rewritten (the port's lines above) or deleted
    marked = [line for line in code(RECIPES / port) if MARK.search(line)]
    assert sorted(marked) == sorted(added), "a line marked `# elastic` that is the DDP script's own"


def main_diff(plain: Path, port: Path) -> str:
    """`main` of the port against the DDP script's, as the README shows it (the port's indentation)."""
    def main_of(path: Path) -> list[str]:
        lines = code(path)
        start = next(i for i, line in enumerate(lines) if line.startswith("def main("))
        end = next(i for i in range(start + 1, len(lines)) if lines[i] and not lines[i][0].isspace())
        return [MARK.sub("", line).rstrip() for line in lines[start:end] if line.strip()]

    a, b = main_of(plain), main_of(port)
    matcher = difflib.SequenceMatcher(a=[x.strip() for x in a], b=[x.strip() for x in b], autojunk=False)
    out = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out += [" " + line for line in b[j1:j2]]
        else:
            out += ["-" + line for line in a[i1:i2]] + ["+" + line for line in b[j1:j2]]
    return "```diff\n" + "\n".join(out) + "\n```\n"


def test_the_readme_shows_the_tutorials_port_as_it_is() -> None:
    diff = main_diff(RECIPES / "tutorial_ddp.py", RECIPES / "tutorial.py")
    assert diff in (REPO / "README.md").read_text(), "README's diff of the tutorial's main is stale; it is:\n" + diff
