"""The fork server's preload (`warm_preload.import_preload`): module by module, it notes the
first whose import initialised CUDA (a forked worker could not use the GPU) and the ones
that failed to import, and leaves torch as it found it."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from elastic._agent.launcher.warm_preload import import_preload

_names = itertools.count()


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a module into tmp_path (on sys.path) under a fresh name; returns the name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    # A module below may replace these; monkeypatch puts the originals back.
    monkeypatch.setattr(torch.cuda, "is_initialized", torch.cuda.is_initialized)
    made: list[str] = []

    def make(source: str) -> str:
        name = f"preload_probe_{next(_names)}"
        (tmp_path / f"{name}.py").write_text(source)
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)


def test_modules_that_leave_cuda_alone_preload_cleanly(make_module) -> None:
    first, second = make_module("import torch\nVALUE = 1\n"), make_module("import json\n")
    report = import_preload(["torch", first, second])
    assert (report.cuda_by, report.failed) == (None, ())
    assert first in sys.modules and second in sys.modules


def test_a_module_that_initialises_cuda_is_named_and_ends_the_preload(make_module) -> None:
    cuda = make_module("import torch\ntorch.cuda.is_initialized = lambda: True  # as torch.cuda.init() would\n")
    after = make_module("VALUE = 1\n")
    report = import_preload(["torch", cuda, after])
    assert report.cuda_by == cuda
    assert after not in sys.modules, "nothing is imported after CUDA was initialised"


def test_a_device_count_through_the_driver_counts_as_initialising_cuda(make_module, monkeypatch) -> None:
    """torch.cuda.is_available() calls cudaGetDeviceCount, i.e. cuInit: a forked child's CUDA is broken."""
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "_nvml_based_avail", lambda: False)
    probing = make_module("import torch\nHAS_GPU = torch.cuda.is_available()\n")
    report = import_preload(["torch", probing])
    assert report.cuda_by == probing
    assert torch._C._cuda_getDeviceCount() == 1 and torch._C._cuda_getDeviceCount.__name__ == "<lambda>", (
        "the watch is taken off torch after the preload"
    )


def test_no_gpu_means_nothing_to_break(make_module) -> None:
    probing = make_module("import torch\nHAS_GPU = torch.cuda.is_available()\n")
    assert not torch.cuda.is_available()  # this machine: no driver or no GPU
    assert import_preload(["torch", probing]).cuda_by is None


def test_a_module_that_fails_to_import_is_noted_in_one_line_and_skipped(make_module) -> None:
    broken = make_module("raise ValueError('no config file\\nsecond line')\n")
    after = make_module("VALUE = 1\n")
    report = import_preload([broken, after])
    assert report.failed == ((broken, "ValueError: no config file"),)
    assert report.cuda_by is None and after in sys.modules
