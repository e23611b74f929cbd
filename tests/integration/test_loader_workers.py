"""The elastic sampler in DataLoaders with worker processes: the same samples at any worker count,
and workers that die with their trainer and ignore the group's SIGTERM."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from support import Jittered, replay
from torch.utils.data import DataLoader

from elastic._agent.launcher.proctree import status
from elastic._worker.data.feed import (
    SafeWorkerInit,
    StepBatchSampler,
    _die_with,
    seeded_samples,
)
from elastic._worker.data.sampler import ElasticSampler


def test_loader_output_does_not_depend_on_its_worker_count() -> None:
    runs = []
    for workers in (0, 2):
        sampler = ElasticSampler(10, batch_size=4, seed=1)
        loader = DataLoader(
            seeded_samples(Jittered(), seed=1), batch_sampler=StepBatchSampler(sampler, 1, 2, steps=6),
            num_workers=workers, worker_init_fn=SafeWorkerInit(os.getpid()) if workers else None,
        )
        runs.append(list(loader))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    assert runs[0][0].shape == (4, 2)


def test_stateful_dataloader_takes_the_step_sampler() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    sampler = ElasticSampler(10, batch_size=3, seed=7)
    expected = replay(ElasticSampler(10, batch_size=3, seed=7), 0, 2, 9)
    loader = stateful.StatefulDataLoader(range(10), batch_sampler=StepBatchSampler(sampler, 0, 2, steps=9), num_workers=2)
    assert [b.tolist() for b in loader] == [[i for _, i in batch] for batch in expected]


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


def test_a_safe_worker_ignores_sigterm_and_runs_the_users_init() -> None:
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            SafeWorkerInit(os.getppid(), then=lambda worker_id: os.write(writer, f"init {worker_id}\n".encode()))(3)
            os.write(writer, b"ready\n")
            time.sleep(2)  # a SIGTERM here is ignored: it lives to exit 0
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as lines:
        assert lines.readline() == "init 3\n" and lines.readline() == "ready\n"
        os.kill(child, signal.SIGTERM)
    _, code = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(code) == 0
