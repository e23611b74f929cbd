from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from cifar_data import (
    SOURCE,
    Transformed,
    eval_transform,
    fake_cifar10,
    load_cifar10,
)
from support import CIFAR_CLASSES, write_cifar10

from elastic._shared.common.errors import UsageError


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
