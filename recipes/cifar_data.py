"""CIFAR-10 for the vision recipe: the files on disk and the transforms.

The loader that feeds each step exactly the samples the elastic sampler gives
this rank, each augmented from (seed, epoch, index) alone, is the library's
(`elastic._worker.data.feed`): an ordinary DataLoader over `run.batch_sampler()`.

On disk: `--data DIR` with DIR/cifar-10-batches-py/ as extracted from the
python version of CIFAR-10 (cifar-10-python.tar.gz): data_batch_1..5,
test_batch, batches.meta. DIR may also name that folder itself. Nothing is
downloaded at run time.

Invariants:
- The files are checked before torchvision reads them: each is present and
  unpickles, with an unpickler that accepts only numpy arrays and plain
  values (a pickle can otherwise run any code), into the CIFAR-10 layout:
  uint8 rows of 3072 pixels, one label in 0..9 per row, ten class names. A
  problem is one `UsageError` line naming the file and where CIFAR-10 comes
  from. The md5 sums of the official release are not required, so a subset
  in the same format (as the tests write) loads too.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch.utils.data import Dataset
from torchvision.transforms import v2

from elastic import UsageError

BASE_FOLDER = torchvision.datasets.CIFAR10.base_folder  # "cifar-10-batches-py"
TRAIN_FILES = tuple(name for name, _ in torchvision.datasets.CIFAR10.train_list)
TEST_FILE = "test_batch"
META_FILE = "batches.meta"
SOURCE = "https://www.cs.toronto.edu/~kriz/cifar.html"
ARCHIVE = "cifar-10-python.tar.gz"

IMAGE_SHAPE = (3, 32, 32)
NUM_CLASSES = 10
# Per-channel statistics of the CIFAR-10 training images.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)

# CIFAR-10's training set size; a smaller test set keeps a smoke run's evaluations short.
FAKE_TRAIN_SIZE, FAKE_TEST_SIZE = 50_000, 1_000



# --- the files on disk ------------------------------------------------------------


def _where_to_get(data: str) -> str:
    return f"download the python version ({ARCHIVE}) from {SOURCE} and extract it there (tar -xzf {ARCHIVE} -C {data})"


def dataset_root(data: str) -> Path:
    """The folder that holds cifar-10-batches-py/ (torchvision's `root`)."""
    path = Path(data)
    return path.parent if path.name == BASE_FOLDER else path


class _ArraysOnly(pickle.Unpickler):
    """Unpickles numpy arrays and plain values; refuses every other global, so a
    crafted file cannot run code (`pickle.load` would run whatever it names)."""

    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # how Python 3 writes bytes at protocol 2
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a CIFAR-10 batch never does")
        return super().find_class(module, name)


def _unpickle(path: Path) -> Any:
    # latin1 reads the byte strings of the original (Python 2) pickles, as torchvision does.
    return _ArraysOnly(io.BytesIO(path.read_bytes()), encoding="latin1").load()


def _check_batch(content: Any) -> int:
    """Rows in a data batch; ValueError saying what is wrong with it."""
    if not isinstance(content, dict) or "data" not in content or "labels" not in content:
        raise ValueError("expected a dict with 'data' and 'labels'")
    data, labels = content["data"], content["labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        raise ValueError(f"'data' must be uint8 rows of 3072 pixels, found {type(data).__name__} {shape}")
    if len(labels) != data.shape[0]:
        raise ValueError(f"{data.shape[0]} images but {len(labels)} labels")
    if not all(isinstance(label, (int, np.integer)) and 0 <= label < NUM_CLASSES for label in labels):
        raise ValueError(f"labels must be integers in 0..{NUM_CLASSES - 1}")
    return data.shape[0]


def _check_meta(content: Any) -> None:
    names = content.get("label_names") if isinstance(content, dict) else None
    if not isinstance(names, list) or len(names) != NUM_CLASSES:
        raise ValueError(f"expected a dict with 'label_names', a list of {NUM_CLASSES} class names")


def check_cifar10(data: str) -> Path:
    """Check the folder (see the module docstring); returns the root to hand torchvision."""
    root = dataset_root(data)
    folder = root / BASE_FOLDER
    if not folder.is_dir():
        raise UsageError(f"--data {data}: no {BASE_FOLDER}/ folder there; CIFAR-10 is not downloaded at run time: {_where_to_get(data)}")
    counts = {}
    for name in (META_FILE, *TRAIN_FILES, TEST_FILE):
        path = folder / name
        if not path.is_file():
            raise UsageError(f"--data {data}: {BASE_FOLDER}/{name} is missing (the folder is incomplete); {_where_to_get(data)}")
        try:
            content = _unpickle(path)
            if name == META_FILE:
                _check_meta(content)
            else:
                counts[name] = _check_batch(content)
        except OSError as exc:
            raise UsageError(f"--data {data}: cannot read {BASE_FOLDER}/{name}: {exc.strerror}") from None
        except Exception as exc:  # noqa: BLE001 - whatever a corrupt pickle raises is one line, not a traceback
            raise UsageError(
                f"--data {data}: {BASE_FOLDER}/{name} is not a CIFAR-10 python batch ({exc}); {_where_to_get(data)}"
            ) from None
    if sum(counts[name] for name in TRAIN_FILES) == 0 or counts[TEST_FILE] == 0:
        raise UsageError(f"--data {data}: the training or the test batches hold no images; {_where_to_get(data)}")
    return root


class _CIFAR10Files(torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10 reading any file set of the release's layout.

    torchvision's integrity check compares md5 sums with the official release;
    with none given it checks that the files exist. Their content was checked
    by `check_cifar10` (a stricter test than md5 of a format, with a better message).
    """

    train_list = [[name, None] for name in TRAIN_FILES]
    test_list = [[TEST_FILE, None]]
    meta = {**torchvision.datasets.CIFAR10.meta, "md5": None}


def load_cifar10(data: str) -> tuple[Dataset, Dataset]:
    """Train and test sets from `--data`, images as PIL (no transform yet)."""
    root = check_cifar10(data)
    return _CIFAR10Files(root, train=True, download=False), _CIFAR10Files(root, train=False, download=False)


def fake_cifar10() -> tuple[Dataset, Dataset]:
    """Random images of CIFAR-10's shape and size, for smoke runs (nothing to learn)."""
    train = torchvision.datasets.FakeData(FAKE_TRAIN_SIZE, IMAGE_SHAPE, NUM_CLASSES, random_offset=0)
    test = torchvision.datasets.FakeData(FAKE_TEST_SIZE, IMAGE_SHAPE, NUM_CLASSES, random_offset=FAKE_TRAIN_SIZE)
    return train, test


# --- transforms -------------------------------------------------------------------


def train_transform() -> Callable[[Any], torch.Tensor]:
    """Random 32x32 crop of the image padded by 4, random horizontal flip, normalisation."""
    return v2.Compose([
        v2.ToImage(),
        v2.RandomCrop(32, padding=4),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])


def eval_transform() -> Callable[[Any], torch.Tensor]:
    """Normalisation only."""
    return v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


class Transformed(Dataset):
    """(image, label) with `transform` applied to the image; deterministic transforms only."""

    def __init__(self, base: Dataset, transform: Callable[[Any], torch.Tensor]) -> None:
        self.base = base
        self.transform = transform

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.base[index]
        return self.transform(image), int(label)
