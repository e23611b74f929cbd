"""The suite's own layout: pytest imports test modules by their basename (rootdir-relative, no
packages), so two test files of one name in different folders fail the whole collection (CI once
failed on tests/unit/test_soak.py beside tests/integration/test_soak.py)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_basename_of_its_own() -> None:
    seen: collections.defaultdict[str, list[str]] = collections.defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename: {clashes}"


def test_a_child_job_never_inherits_a_round_identity_published_in_the_test_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from support import worker_env

    from elastic._shared.protocol import round_identity

    monkeypatch.setenv(round_identity.ROUND_ENV, "stale-launch/3")
    assert round_identity.ROUND_ENV not in worker_env()
    assert worker_env(**{round_identity.ROUND_ENV: "given"})[round_identity.ROUND_ENV] == "given"
