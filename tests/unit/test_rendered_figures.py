"""Every measured figure of README.md and docs/results.md is rendered from a benchmark's result file.

A figure block (`<!-- figures: VIEW -->...<!-- /figures -->`) must be exactly what
`python benchmarks/render.py` makes of benchmarks/results/*.json, so a figure edited by hand, or a
result file measured again without rendering, fails here. Outside the blocks the two pages hold no
measured figure: no decimal number and no number with a unit of time, size, speed or ratio in their
prose (commands and code are not prose).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import render  # noqa: E402

FIGURE_PAGES = [REPO / "README.md", REPO / "docs" / "results.md"]
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
LINK_TARGET = re.compile(r"\]\([^)]*\)")
MEASURED = re.compile(r"(?<![\w.-])\d+(?:[.,]\d+)?\s?(?:s|ms|%|x|MB/s|GB/s|MB|GB|minutes?|seconds?)(?![\w/])|(?<![\w.:-])(?<!torch )\d+\.\d+(?![\w.])")


@pytest.fixture(scope="module")
def views() -> dict[str, render.View]:
    return render.views()


def outside_blocks(text: str) -> str:
    """The prose of `text`: no figure blocks, no code, no link targets."""
    text = render.BLOCK.sub("", text)
    return LINK_TARGET.sub("]", CODE_SPAN.sub("", FENCE.sub("", text)))


def test_every_figure_block_is_its_rendering(views) -> None:
    paths = render.documents()
    assert set(FIGURE_PAGES) <= set(paths), "README.md and docs/results.md each show rendered figures"
    stale = render.stale(paths, views, render.LazyResults(render.RESULTS))
    assert not stale, (f"{[str(path.relative_to(REPO)) for path, _ in stale]}: a figure block is not what its result "
                       "file renders; run python benchmarks/render.py (never edit a figure by hand)")


def test_every_result_file_is_shown_and_every_view_is_used(views) -> None:
    used = {block.view for path in render.documents() for block in render.blocks(path)}
    assert used == set(views), f"views no page shows: {set(views) - used}; blocks of no view: {used - set(views)}"
    assert sorted(render.LazyResults(render.RESULTS)), "no result files in benchmarks/results"


def test_a_hand_edited_figure_in_the_readme_is_caught(views) -> None:
    readme = REPO / "README.md"
    text = readme.read_text()
    [block, *_] = render.blocks(readme)
    digit = re.search(r"\d", block.body)
    assert digit is not None, "the README's first block shows figures"
    at = text.index(block.body) + digit.start()
    edited = text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:]
    assert render.render_text(edited, readme, views, render.LazyResults(render.RESULTS)) == text


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=lambda p: p.name)
def test_no_measured_figure_stands_outside_a_block(page: Path) -> None:
    found = [line.strip() for line in outside_blocks(page.read_text()).splitlines() if MEASURED.search(line)]
    assert not found, f"{page.name}: figures typed outside a rendered block (render them, or give only the command): {found}"


def test_the_figure_finder_sees_typed_figures_and_skips_commands() -> None:
    assert MEASURED.search("the stall is 0.54 s") and MEASURED.search("1.003 of a plain loop")
    assert MEASURED.search("it costs 3 % of a step") and MEASURED.search("upload 135 MB/s")
    assert not MEASURED.search("2 agents on a 2-core machine, issue 41, torch 2.14")
    assert outside_blocks("run `python benchmarks/x.py --kills 0.5`\n```sh\necho 1.5 s\n```\n").strip() == "run"
