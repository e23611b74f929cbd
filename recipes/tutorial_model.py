"""The tutorial's model, data, evaluation and config file: what recipes/tutorial*.py share.

Nothing here knows of the runtime: the DDP versions (tutorial_ddp.py, tutorial_config_ddp.py) and
the fault-tolerant ones (tutorial.py, tutorial_config.py) import the same model and data, so the
lines that differ between them are the port and nothing else (tests/unit/test_tutorial_port.py
counts them).
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

FEATURES, CLASSES, SAMPLES, TEST_SAMPLES = 32, 8, 8192, 1024
CONFIG = Path(__file__).with_name("tutorial.toml")


class Teacher(Dataset):
    """Points labelled by a fixed random linear teacher; each read adds a little noise (an augmentation)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, noise: float = 0.05) -> None:
        self.x, self.y, self.noise = x, y, noise

    @classmethod
    def synthetic(cls, *, test: bool = False) -> Teacher:
        """The training set, or (`test`) a held-out one of the same teacher: the same on every rank and run."""
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, FEATURES, generator=generator)
        teacher = torch.randn(FEATURES, CLASSES, generator=generator)
        if test:
            x = torch.randn(TEST_SAMPLES, FEATURES, generator=torch.Generator().manual_seed(1))
        return cls(x, (x @ teacher).argmax(dim=1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + self.noise * torch.randn(FEATURES), self.y[index]


def npz_data(path: str) -> tuple[Teacher, Teacher]:
    """`--data FILE.npz`: your own points (arrays `x`, N x FEATURES floats, and `y`, labels in 0..CLASSES-1),
    checked (a bad file is one line and exit 2), never unpickled; the last eighth is held out for the test set."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            x, y = torch.from_numpy(arrays["x"]).float(), torch.from_numpy(arrays["y"]).long()
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise argparse.ArgumentTypeError(f"{path} is not an .npz file with arrays x and y ({exc})") from None
    if x.ndim != 2 or x.shape[1] != FEATURES or y.shape != (len(x),) or len(x) < 2:
        raise argparse.ArgumentTypeError(f"{path}: x must be N x {FEATURES} (N >= 2) and y N labels, not "
                                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if y.min() < 0 or y.max() >= CLASSES:
        raise argparse.ArgumentTypeError(f"{path}: labels must be in 0..{CLASSES - 1}")
    cut = len(x) - max(1, len(x) // 8)
    return Teacher(x[:cut], y[:cut]), Teacher(x[cut:], y[cut:])


def datasets(given: tuple[Teacher, Teacher] | str | None) -> tuple[Teacher, Teacher]:
    """The training and test sets: those `--data` read (`npz_data`), a file's path, else the synthetic task."""
    if isinstance(given, str):
        return npz_data(given)
    return given if given is not None else (Teacher.synthetic(), Teacher.synthetic(test=True))


def positive_int(text: str) -> int:
    """An argparse type: a whole number, 1 or more (a bad value is argparse's one line and exit 2)."""
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


class Net(nn.Module):
    def __init__(self, hidden: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@torch.no_grad()
def evaluate(model: nn.Module, test_set: Dataset, batch_size: int = 256) -> float:
    """Accuracy on the test set, read in a shuffled order with its noise: both drawn from torch's generator."""
    model.eval()
    correct = 0
    for x, y in DataLoader(test_set, batch_size=batch_size, shuffle=True):
        correct += int((model(x).argmax(dim=1) == y).sum())
    model.train()
    return correct / len(test_set)  # type: ignore[arg-type]


def load_config(overrides: Sequence[str], path: Path = CONFIG) -> dict[str, Any]:
    """The config file (TOML), with `section.key=value` overrides as hydra takes them on a command line
    (`train.epochs=3 train.ckpt_dir=ckpt`; a value reads as TOML, or as text); a bad one ends the program
    with one line and exit status 2, as a bad flag does."""
    import tomllib  # Python 3.11+

    config = tomllib.loads(path.read_text())
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not isinstance(config.get(section), dict):
            print(f"{Path(sys.argv[0]).name}: error: override {item!r} is not SECTION.KEY=VALUE with a section of "
                  f"{path.name}: {', '.join(config)}", file=sys.stderr)
            raise SystemExit(2)
        try:
            config[section][name] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            config[section][name] = text
    return config
