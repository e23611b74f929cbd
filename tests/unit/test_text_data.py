from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
import text_data
from text_data import load_corpus, split_corpus, stdlib_source_files

from elastic._shared.common.errors import UsageError


def test_default_corpus_is_stdlib_source_in_a_fixed_order() -> None:
    files = list(stdlib_source_files())
    assert files and all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)
    root = Path(sysconfig.get_paths()["stdlib"])  # the walk's order is that of the relative paths, sorted:
    assert files == sorted(  # the bytes of every corpus made before it walked lazily
        (p for p in root.rglob("*.py") if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix())
    assert load_corpus(None, limit=100_000) == load_corpus(None, limit=100_000)
    assert len(load_corpus(None, limit=100_000)) == 100_000


def test_windows_give_inputs_and_next_byte_targets() -> None:
    corpus = bytes(range(200))
    train, val = split_corpus(corpus, block_size=8, val_fraction=0.1)
    x, y = train.batch(torch.tensor([0, 2]))
    assert x.shape == y.shape == (2, 8) and x.dtype == torch.int64
    assert x[1].tolist() == list(range(16, 24)) and y[1].tolist() == list(range(17, 25))
    assert len(train) == (180 - 1) // 8 and len(val) == (20 - 1) // 8


def test_held_out_bytes_never_appear_in_training_windows() -> None:
    corpus = bytes(range(256)) * 2
    train, val = split_corpus(corpus, block_size=16, val_fraction=0.25)
    assert train.tokens.numel() + val.tokens.numel() == len(corpus)
    last_train_byte = len(train) * 16  # index of the last target byte of the last window
    assert last_train_byte < train.tokens.numel()


def test_a_corpus_shorter_than_two_sequences_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="has 20 bytes, fewer than two sequences of 17 bytes"):
        split_corpus(b"x" * 20, block_size=16, source="the corpus")


def test_a_folder_is_read_in_sorted_order_without_hidden_files(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_text("first")
    (tmp_path / ".hidden").write_text("never")
    assert load_corpus(str(tmp_path)) == b"first\nsecond"


def test_missing_or_empty_data_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file or folder"):
        load_corpus(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="holds no files"):
        load_corpus(str(tmp_path))


def test_the_walk_sorts_as_relative_paths_do_and_skips_caches_and_linked_folders(tmp_path: Path) -> None:
    for name in ("abc.py", "abc/x.py", "ab/z.py", "abc_d.py", "a-b.py", "__pycache__/c.py", "site-packages/s.py",
                 "B/y.py", "abc/__pycache__/w.py", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "linked").symlink_to(tmp_path / "B")
    walked = [p.relative_to(tmp_path).as_posix() for p in text_data._sorted_sources(tmp_path)]
    assert walked == ["B/y.py", "a-b.py", "ab/z.py", "abc.py", "abc/x.py", "abc_d.py"]
