"""Byte-level text data for the GPT recipe.

The default corpus is the Python standard library's own source files: real
text on every machine that runs this recipe, with no download. Files are read
in sorted order of their path relative to the stdlib root, so a given Python
installation always yields the same bytes.

A corpus is cut into non-overlapping windows of `block_size + 1` bytes (input
plus next-token targets); a sample index names one window. The tail of the
corpus is held out for validation and never trained on.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from elastic import UsageError

DEFAULT_CORPUS_LIMIT = 4 * 2**20
"""Bytes of stdlib source to gather by default: plenty for a CPU-sized model."""
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_files() -> Iterator[Path]:
    """The stdlib's `*.py` files, lazily, in sorted order of their path relative to the stdlib root
    (installed packages and caches excluded; symlinked folders not followed). Lazily: a corpus of
    the first few MB walks only the first few folders, so a replacement worker starts in a blink
    instead of walking the whole library (about 0.4 s) on every restart."""
    return _sorted_sources(Path(sysconfig.get_paths()["stdlib"]))


def _sorted_sources(folder: Path) -> Iterator[Path]:
    # Depth first, entries by name, a folder's as "name/": the order of the full relative paths
    # as strings (a folder's files all share the prefix "name/", so they sort together, where
    # "name/" sorts among its siblings).
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda e: e.name + "/" if _is_folder(e) else e.name)
    for entry in entries:
        if _is_folder(entry):
            if entry.name not in EXCLUDED_DIRS:
                yield from _sorted_sources(Path(entry.path))
        elif entry.name.endswith(".py"):
            yield Path(entry.path)


def _is_folder(entry: os.DirEntry[str]) -> bool:
    return entry.is_dir() and not entry.is_symlink()


def _read_concatenated(files: Iterable[Path], limit: int | None) -> bytes:
    chunks: list[bytes] = []
    size = 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None
        chunks.append(data)
        size += len(data)
        if limit is not None and size >= limit:
            break
    blob = b"\n".join(chunks)
    return blob if limit is None else blob[:limit]


def load_corpus(data: str | None, *, limit: int = DEFAULT_CORPUS_LIMIT) -> bytes:
    """Bytes of `data` (a file, or every non-hidden file under a folder), or the default corpus."""
    if data is None:
        return _read_concatenated(stdlib_source_files(), limit)
    path = Path(data)
    if path.is_file():
        return _read_concatenated([path], None)
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise UsageError(f"--data {data}: the folder holds no files; point it at a text file or a folder of text files")
        return _read_concatenated(files, None)
    raise UsageError(f"--data {data}: no such file or folder")


@dataclass(frozen=True)
class TokenWindows:
    """Bytes viewed as windows: sample i is tokens[i*block_size : i*block_size + block_size + 1]."""

    tokens: torch.Tensor
    block_size: int

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.block_size)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, both (len(indices), block_size) int64."""
        starts = indices.to(torch.int64) * self.block_size
        offsets = torch.arange(self.block_size + 1)
        windows = self.tokens[starts[:, None] + offsets].to(torch.int64)
        return windows[:, :-1], windows[:, 1:]


def split_corpus(
    corpus: bytes, *, block_size: int, val_fraction: float = 0.05, source: str = "the corpus"
) -> tuple[TokenWindows, TokenWindows]:
    """Train and held-out windows; at least one of each, else a `UsageError`."""
    window = block_size + 1
    if len(corpus) < 2 * window:
        raise UsageError(
            f"{source} has {len(corpus)} bytes, fewer than two sequences of {window} bytes "
            "(one to train on, one held out); use more text or a smaller --block-size"
        )
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    n_val = max(window, int(len(corpus) * val_fraction))
    n_val = min(n_val, len(corpus) - window)
    return TokenWindows(tokens[:-n_val], block_size), TokenWindows(tokens[-n_val:], block_size)
