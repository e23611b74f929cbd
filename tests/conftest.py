"""Shared fixtures: small corpora made by the tests, free ports, the recipes on sys.path."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))

from support import free_port, make_text  # noqa: E402


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    """About 40 KB of generated English-like text in one file."""
    path = tmp_path / "corpus.txt"
    path.write_text(make_text(random.Random(0), 40_000))
    return path


@pytest.fixture
def port() -> int:
    return free_port()
