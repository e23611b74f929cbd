"""CIFAR-10 for the vision recipe: the files on disk, the transforms, and a loader
that feeds each step exactly the samples the elastic sampler gives this rank.

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
- The random augmentation of a sample is a function of (seed, epoch, index)
  only: not of the DataLoader worker that happens to load it, the number of
  workers, the world size, or where the job was restarted.
- `step_loader` yields, step after step, this rank's share of the next global
  batch of the sampler's stream, starting where the sampler stands when it is
  built; each batch carries its sample indices so the loop can check them
  against `ElasticSampler.local_batch`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import io
import os
import pickle
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from elastic.errors import UsageError
from elastic.sampler import ElasticSampler

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

_SAMPLE_SEED_MASK = 2**63 - 1


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


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation in one epoch (a hash: no two keys collide in practice)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SAMPLE_SEED_MASK


class SeededAugmentation(Dataset):
    """Samples keyed by (epoch, index): (index, augmented image, label).

    torchvision's random transforms draw from torch's global generator; here
    that generator is seeded from `sample_seed(seed, epoch, index)` around the
    transform and put back after it, so the result depends on the key alone
    and the caller's random stream is untouched.
    """

    def __init__(self, base: Dataset, transform: Callable[[Any], torch.Tensor], seed: int) -> None:
        self.base = base
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, torch.Tensor, int]:
        epoch, index = key
        image, label = self.base[index]
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: CUDA's is never touched
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            image = self.transform(image)
        return index, image, int(label)


# --- the loader of the steps to come -----------------------------------------------


class UpcomingBatches:
    """A batch sampler: this rank's (epoch, index) keys for each of the next `steps` steps.

    It replays the sampler's stream from the sampler's position at
    construction, on a copy, so the sampler the loop advances is never touched
    ahead of time. The epoch of a key is that of its position in the stream: a
    global batch may straddle two epochs.
    """

    def __init__(self, sampler: ElasticSampler, *, rank: int, world_size: int, steps: int) -> None:
        self._state = sampler.state_dict()
        self._num_samples, self._batch_size, self._seed = sampler.num_samples, sampler.batch_size, sampler.seed
        self.rank, self.world_size, self.steps = rank, world_size, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        replay = ElasticSampler(self._num_samples, batch_size=self._batch_size, seed=self._seed)
        replay.load_state_dict(self._state)
        start = self.rank * self._batch_size
        for _ in range(self.steps):
            epoch, consumed = replay.state.epoch, replay.state.consumed
            indices = replay.global_batch(self.world_size)[start : start + self._batch_size].tolist()
            yield [
                (epoch + (consumed + start + offset) // self._num_samples, index)
                for offset, index in enumerate(indices)
            ]
            replay.advance(self.world_size)


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process the moment `parent` dies.

    A loader worker is forked from a training process that belongs to a gloo or
    NCCL group, and so holds copies of its connections to the other ranks. When
    that process is SIGKILLed, the connections stay open in its orphaned workers
    until they notice (up to 5 s), and meanwhile the other ranks wait in their
    collectives instead of failing at once and getting the job restarted.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(0)


def _worker_init(parent: int, worker_id: int) -> None:
    _die_with(parent)
    # torchrun stops a group with SIGTERM to each worker's process group, which
    # holds its loader workers too: were they to die of it, the trainer would
    # fail on a dead loader instead of finishing its step and committing the
    # preemption checkpoint. They end with the trainer (above) or its loader.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A worker transforms one image at a time: several intra-op threads per
    # worker would only oversubscribe the cores the training process uses.
    torch.set_num_threads(1)


def step_loader(
    dataset: SeededAugmentation,
    sampler: ElasticSampler,
    *,
    rank: int,
    world_size: int,
    steps: int,
    workers: int,
    pin_memory: bool = False,
) -> DataLoader:
    """Batches (indices, images, labels) of this rank for the next `steps` steps."""
    return DataLoader(
        dataset,
        batch_sampler=UpcomingBatches(sampler, rank=rank, world_size=world_size, steps=steps),
        num_workers=workers,
        # Forked: workers must share the trainer's pid as their parent (see _die_with),
        # and fork is what makes them cheap; not every platform default is fork.
        multiprocessing_context="fork" if workers else None,
        pin_memory=pin_memory,
        worker_init_fn=functools.partial(_worker_init, os.getpid()) if workers else None,
        # A generator of its own: without one, each new iterator draws its base seed
        # from torch's global generator, and a resumed run (which builds its iterator
        # at another step) would leave that stream somewhere else than a clean run.
        generator=torch.Generator().manual_seed(sampler.seed * 1_000_003 + rank),
    )
