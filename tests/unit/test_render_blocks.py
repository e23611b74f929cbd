"""benchmarks/render.py: a rendered block is its view's rendering of the result files, and a hand edit shows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import provenance  # noqa: E402
import render  # noqa: E402
import views  # noqa: E402


def stall_view(results: render.Results) -> str:
    soak = results["soak"]
    return views.table(["setting", "median"], [["keep", views.seconds(soak["results"]["keep"])]]) + views.measured(soak)


KNOWN = {"soak/summary": stall_view}
PAGE = "# Results\n\nSome words.\n\n<!-- figures: soak/summary -->\nold\n<!-- /figures -->\n\nMore words.\n"


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> render.LazyResults:
    monkeypatch.setattr(provenance, "_git", lambda *args: {"rev-parse": "b" * 40, "status": ""}[args[0]])
    provenance.write_result(tmp_path / "results" / "soak.json", "soak", {"keep": 0.8123}, argv=["--kills", "100"])
    return render.LazyResults(tmp_path / "results")


def test_a_block_is_replaced_by_its_rendering_and_the_words_around_it_stay(tmp_path: Path, results) -> None:
    page = tmp_path / "results.md"
    page.write_text(PAGE)
    [(path, text)] = render.stale([page], KNOWN, results)
    assert path == page
    assert text.startswith("# Results\n\nSome words.\n\n<!-- figures: soak/summary -->\n| setting | median |")
    assert "| keep | 0.81 s |" in text and "`--kills 100` at commit bbbbbbbbbb" in text
    assert text.endswith("<!-- /figures -->\n\nMore words.\n")
    page.write_text(text)
    assert render.stale([page], KNOWN, results) == [], "a rendered page is stable"


def test_a_figure_edited_by_hand_inside_a_block_is_found(tmp_path: Path, results) -> None:
    page = tmp_path / "results.md"
    page.write_text(render.render_text(PAGE, page, KNOWN, results).replace("0.81 s", "0.61 s"))
    [(path, text)] = render.stale([page], KNOWN, results)
    assert "0.81 s" in text


def test_an_unknown_view_a_missing_result_file_and_an_open_block_are_errors_naming_where(tmp_path: Path, results) -> None:
    page = tmp_path / "results.md"
    with pytest.raises(render.RenderError, match=r"results.md:5: no view named 'soak/other'"):
        render.render_text(PAGE.replace("soak/summary", "soak/other"), page, KNOWN, results)
    empty = render.LazyResults(tmp_path / "nothing")
    with pytest.raises(render.RenderError, match=r"results.md:5: no result file .*soak.json: run its benchmark"):
        render.render_text(PAGE, page, KNOWN, empty)
    page.write_text(PAGE.replace("<!-- /figures -->", ""))
    with pytest.raises(render.RenderError, match="1 '<!-- figures: VIEW -->' openings but 0 closed blocks"):
        render.blocks(page)
