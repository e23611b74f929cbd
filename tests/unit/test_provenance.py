"""benchmarks/provenance.py: a result file says how its figures were made, and holds only JSON."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import provenance  # noqa: E402


def test_a_result_file_carries_command_commit_versions_machine_and_date(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"rev-parse": "a" * 40, "status": " M README.md"}
    monkeypatch.setattr(provenance, "_git", lambda *args: answers[args[0]])  # a unit test starts no git
    path = provenance.write_result(tmp_path / "sub" / "r.json", "demo", {"stall": [0.5, math.nan], "n": 3}, argv=["--kills", "2"])
    document = provenance.read_result(path)
    assert document["benchmark"] == "demo"
    assert document["results"] == {"stall": [0.5, None], "n": 3}  # NaN is not JSON: None
    made = document["provenance"]
    assert made["command"] == "--kills 2"
    assert made["commit"] == "a" * 40 and made["dirty"] is True
    assert made["python"] and made["date"].endswith("+00:00") and made["machine"]["cores"] >= 1
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left beside it


def test_a_file_without_its_three_parts_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": {}}))
    with pytest.raises(ValueError, match="not a benchmark result file"):
        provenance.read_result(bad)


def test_the_machine_carries_its_load_so_a_shared_machine_shows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provenance, "_git", lambda *args: None)
    monkeypatch.setattr(provenance.os, "getloadavg", lambda: (5.0, 4.0, 3.5))
    made = provenance.read_result(provenance.write_result(tmp_path / "r.json", "x", {}))["provenance"]
    assert made["machine"]["load_15min"] == 3.5


def test_rewritten_result_files_do_not_make_the_tree_dirty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A series of benchmarks writes benchmarks/results/ one file after another: the later ones were measured
    on the same code, so git's status is asked without that folder."""
    asked = []
    monkeypatch.setattr(provenance, "_git", lambda *args: asked.append(args) or ("b" * 40 if args[0] == "rev-parse" else ""))
    made = provenance.read_result(provenance.write_result(tmp_path / "r.json", "x", {}))["provenance"]
    [status] = [args for args in asked if args[0] == "status"]
    assert ":(exclude)benchmarks/results" in status and made["dirty"] is False
