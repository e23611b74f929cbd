from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cifar_data import (
    SOURCE,
    SeededAugmentation,
    Transformed,
    UpcomingBatches,
    _die_with,
    eval_transform,
    fake_cifar10,
    load_cifar10,
    step_loader,
    train_transform,
)
from support import CIFAR_CLASSES, write_cifar10

from elastic.errors import UsageError
from elastic.proctree import status
from elastic.sampler import ElasticSampler


@pytest.fixture
def cifar(tmp_path: Path) -> Path:
    return write_cifar10(tmp_path, train=50, test=10)


def batch_file(root: Path, name: str) -> Path:
    return root / "cifar-10-batches-py" / name


def rewrite(path: Path, change) -> None:
    with open(path, "rb") as f:
        content = pickle.load(f, encoding="latin1")
    change(content)
    with open(path, "wb") as f:
        pickle.dump(content, f, protocol=2)


def test_a_folder_in_the_release_format_loads_through_torchvision(cifar: Path) -> None:
    train, test = load_cifar10(str(cifar))
    assert (len(train), len(test)) == (50, 10)
    assert train.classes == CIFAR_CLASSES
    with open(batch_file(cifar, "data_batch_1"), "rb") as f:
        first = pickle.load(f, encoding="latin1")
    image, label = train[0]
    # Rows hold the red, green and blue planes one after the other; images come out HWC.
    assert np.array_equal(np.asarray(image), first["data"][0].reshape(3, 32, 32).transpose(1, 2, 0))
    assert label == first["labels"][0]


def test_the_batches_folder_itself_is_accepted_as_data(cifar: Path) -> None:
    train, _ = load_cifar10(str(cifar / "cifar-10-batches-py"))
    assert len(train) == 50


def test_a_missing_folder_says_what_is_expected_and_where_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as error:
        load_cifar10(str(tmp_path / "nowhere"))
    message = str(error.value)
    assert "no cifar-10-batches-py/ folder there" in message and "not downloaded at run time" in message
    assert SOURCE in message and "cifar-10-python.tar.gz" in message and "\n" not in message


def test_a_missing_file_is_named(cifar: Path) -> None:
    batch_file(cifar, "data_batch_3").unlink()
    with pytest.raises(UsageError, match=r"cifar-10-batches-py/data_batch_3 is missing \(the folder is incomplete\)"):
        load_cifar10(str(cifar))


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        ("data_batch_2", lambda c: c.update(data=c["data"][:, :100]), "'data' must be uint8 rows of 3072 pixels"),
        ("data_batch_2", lambda c: c.update(data=c["data"].astype(np.float32)), "'data' must be uint8 rows"),
        ("data_batch_4", lambda c: c["labels"].__setitem__(0, 10), "labels must be integers in 0..9"),
        ("test_batch", lambda c: c["labels"].pop(), "10 images but 9 labels"),
        ("test_batch", lambda c: c.pop("labels"), "expected a dict with 'data' and 'labels'"),
        ("batches.meta", lambda c: c["label_names"].pop(), "'label_names', a list of 10 class names"),
    ],
)
def test_a_malformed_file_is_named_with_what_is_wrong(cifar: Path, name: str, change, reason: str) -> None:
    rewrite(batch_file(cifar, name), change)
    with pytest.raises(UsageError) as error:
        load_cifar10(str(cifar))
    message = str(error.value)
    assert f"cifar-10-batches-py/{name} is not a CIFAR-10 python batch" in message and reason in message
    assert SOURCE in message


def test_a_truncated_file_is_refused(cifar: Path) -> None:
    path = batch_file(cifar, "data_batch_5")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(UsageError, match="data_batch_5 is not a CIFAR-10 python batch"):
        load_cifar10(str(cifar))


class _Mkdir:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def test_a_pickle_that_would_run_code_is_refused_without_running_it(cifar: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with open(batch_file(cifar, "data_batch_1"), "wb") as f:
        pickle.dump({"data": _Mkdir(marker), "labels": []}, f, protocol=2)
    with pytest.raises(UsageError, match=r"data_batch_1 is not a CIFAR-10 python batch \(it refers to posix.mkdir"):
        load_cifar10(str(cifar))
    assert not marker.exists()


def test_fake_data_has_the_shape_of_cifar10() -> None:
    train, test = fake_cifar10()
    assert (len(train), len(test)) == (50_000, 1_000)
    image, label = Transformed(test, eval_transform())[3]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label < 10


def test_augmentation_depends_only_on_seed_epoch_and_index(cifar: Path) -> None:
    train, _ = load_cifar10(str(cifar))
    augmented = SeededAugmentation(train, train_transform(), seed=3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = [augmented[(0, i)] for i in range(8)]
    assert torch.equal(torch.get_rng_state(), before), "the caller's random stream is untouched"
    torch.manual_seed(12345)  # another global state: same images
    again = [augmented[(0, i)] for i in range(8)]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, again))
    next_epoch = [augmented[(1, i)] for i in range(8)]
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(first, next_epoch)), "each epoch draws new crops and flips"
    index, image, label = first[2]
    assert (index, image.shape, label) == (2, (3, 32, 32), train[2][1])


def replay(sampler: ElasticSampler, rank: int, world_size: int, steps: int) -> list[list[tuple[int, int]]]:
    """What the loop sees: local_batch, then advance; keys carry the epoch of their stream position."""
    out = []
    for _ in range(steps):
        epoch, consumed = sampler.state.epoch, sampler.state.consumed
        local = sampler.local_batch(rank, world_size).tolist()
        first = consumed + rank * sampler.batch_size
        out.append([(epoch + (first + j) // sampler.num_samples, i) for j, i in enumerate(local)])
        sampler.advance(world_size)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_upcoming_batches_are_the_samplers_local_batches_across_epoch_ends(rank: int) -> None:
    sampler = ElasticSampler(10, batch_size=3, seed=7)  # a global batch of 6 straddles epochs
    plan = list(UpcomingBatches(sampler, rank=rank, world_size=2, steps=7))
    assert sampler.state.consumed == 0, "the plan replays a copy"
    assert plan == replay(sampler, rank, 2, 7)
    other = list(UpcomingBatches(ElasticSampler(10, batch_size=3, seed=7), rank=1 - rank, world_size=2, steps=7))
    assert {epoch for batch in plan + other for epoch, _ in batch} == {0, 1, 2, 3, 4}  # 42 samples
    for epoch in range(4):  # complete epochs hold each sample once over both ranks
        assert sorted(i for batch in plan + other for e, i in batch if e == epoch) == list(range(10))


def test_upcoming_batches_start_where_the_sampler_stands() -> None:
    whole = list(UpcomingBatches(ElasticSampler(10, batch_size=3, seed=7), rank=1, world_size=2, steps=7))
    resumed = ElasticSampler(10, batch_size=3, seed=7)
    for _ in range(4):
        resumed.advance(2)
    assert list(UpcomingBatches(resumed, rank=1, world_size=2, steps=3)) == whole[4:]


def test_loader_output_does_not_depend_on_its_worker_count(cifar: Path) -> None:
    train, _ = load_cifar10(str(cifar))
    augmented = SeededAugmentation(train, train_transform(), seed=1)
    runs = []
    for workers in (0, 2):
        sampler = ElasticSampler(len(train), batch_size=8, seed=1)
        loader = step_loader(augmented, sampler, rank=1, world_size=2, steps=5, workers=workers)
        runs.append(list(loader))
    for (i0, x0, y0), (i2, x2, y2) in zip(*runs, strict=True):
        assert torch.equal(i0, i2) and torch.equal(x0, x2) and torch.equal(y0, y2)
    assert runs[0][0][1].shape == (8, 3, 32, 32)


def test_a_loader_worker_dies_with_its_parent() -> None:
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the training process, to be killed
        try:
            if os.fork() == 0:  # its loader worker
                _die_with(os.getppid())
                os.write(writer, f"{os.getpid()}\n".encode())
                time.sleep(60)
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as lines:
        worker = int(lines.readline())
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)

    def alive() -> bool:
        return status(worker).get("State", "Z").startswith(("S", "R"))  # gone or a zombie: dead

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if alive():
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the orphaned worker lived on")
