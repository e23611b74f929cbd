"""Pieces of the state manager: snapshot copies, the writer thread, RNG states, compat, faults."""

from __future__ import annotations

import io
import random
import threading

import numpy as np
import pytest
import torch

from elastic._shared.common.errors import CheckpointMismatchError, UsageError
from elastic._worker.checkpoint.compat import check_model, check_optimizer
from elastic._worker.checkpoint.snapshot import BufferPool, DeferredCopy, copy_now
from elastic._worker.checkpoint.writer import BackgroundWriter
from elastic._worker.runtime.rng import get_rng_state, seed_all, set_rng_state
from elastic.chaos import Fault, FaultInjector, parse_faults

CPU = torch.device("cpu")


# -- snapshot --------------------------------------------------------------------


def test_copy_now_holds_the_values_at_the_call() -> None:
    stats = torch.ones(3)
    tree = {"stats": stats, "meta": {"step": 3, "lrs": [0.1]}}
    copied = copy_now(tree, BufferPool(False), CPU)
    stats.add_(5)  # a forward pass right after the save
    tree["meta"]["lrs"].append(0.2)
    assert torch.equal(copied["stats"], torch.ones(3))
    assert copied["meta"] == {"step": 3, "lrs": [0.1]}, "containers are rebuilt"


def test_deferred_copy_holds_the_optimizer_step_until_it_has_read_the_tensors() -> None:
    live = torch.arange(1000.0)
    deferred = DeferredCopy(CPU)
    released = threading.Event()

    def optimizer_step() -> None:
        deferred.wait_sources_free()
        live.mul_(100)
        released.set()

    thread = threading.Thread(target=optimizer_step)
    thread.start()
    assert not released.wait(0.2), "the step went ahead before the copy"
    tree = deferred.run(lambda: {"w": live}, BufferPool(False))
    thread.join(5)
    assert released.is_set() and deferred.sources_free
    assert torch.equal(tree["w"], torch.arange(1000.0))


def test_a_failing_build_releases_the_loop() -> None:
    deferred = DeferredCopy(CPU)
    with pytest.raises(RuntimeError, match="state_dict hook"):
        deferred.run(lambda: (_ for _ in ()).throw(RuntimeError("state_dict hook failed")), BufferPool(False))
    deferred.wait_sources_free()  # returns at once


def test_tied_tensors_share_one_buffer_and_buffers_are_reused() -> None:
    weight = torch.randn(4, 4)
    pool = BufferPool(False)
    first = copy_now({"a": weight, "b": weight}, pool, CPU)
    assert first["a"] is first["b"]
    second = copy_now({"a": weight, "b": weight}, pool, CPU)
    assert second["a"] is first["a"], "a steady-state save allocates nothing"
    assert pool.nbytes == weight.numel() * weight.element_size()


# -- writer ----------------------------------------------------------------------


def test_writer_runs_one_job_at_a_time_and_returns_results() -> None:
    writer = BackgroundWriter()
    gate = threading.Event()
    writer.submit(lambda: gate.wait(5) and "first")
    assert writer.busy
    gate.set()
    assert writer.submit(lambda: "second") == "first", "submit waited for the job in flight"
    assert writer.wait() == "second"
    assert not writer.busy and writer.wait() is None
    writer.close()


def test_writer_errors_surface_in_the_caller() -> None:
    writer = BackgroundWriter()

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.submit(lambda: None)
    assert writer.wait() is None, "an error is raised once, not forever"


# -- rng -------------------------------------------------------------------------


def draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), random.gauss(0, 1), float(np.random.randn())


def test_rng_state_round_trips_through_plain_types() -> None:
    seed_all(7, CPU)
    random.gauss(0, 1)  # leave a cached gaussian in both generators
    np.random.randn()
    state = get_rng_state(CPU)
    expected = draw()
    blob = io.BytesIO()  # the state must survive weights_only loading
    torch.save(state, blob)
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)
    seed_all(999, CPU)
    set_rng_state(loaded, CPU)
    assert draw() == expected


# -- compat ----------------------------------------------------------------------


def test_model_mismatch_names_the_first_key_and_both_shapes() -> None:
    small, wide = torch.nn.Linear(4, 8), torch.nn.Linear(4, 16)
    with pytest.raises(CheckpointMismatchError, match=r"weight has shape \[8, 4\] there and \[16, 4\] here"):
        check_model("step_00000001", wide.state_dict(), small.state_dict())
    with pytest.raises(CheckpointMismatchError, match="it has no extra.weight"):
        check_model("step_00000001", {**small.state_dict(), "extra.weight": torch.zeros(1)}, small.state_dict())
    with pytest.raises(CheckpointMismatchError, match="which this model lacks"):
        check_model("step_00000001", {"weight": small.weight}, small.state_dict())
    check_model("step_00000001", small.state_dict(), torch.nn.Linear(4, 8).state_dict())


def test_optimizer_mismatch_is_caught() -> None:
    model = torch.nn.Linear(4, 8)
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    check_optimizer("c", torch.optim.AdamW(torch.nn.Linear(4, 8).parameters()), adam.state_dict())
    with pytest.raises(CheckpointMismatchError, match="another optimizer"):
        check_optimizer("c", torch.optim.SGD(torch.nn.Linear(4, 8).parameters(), lr=0.1), adam.state_dict())
    with pytest.raises(CheckpointMismatchError, match=r"exp_avg of parameter 0 has shape \[8, 4\] there and \[9, 4\] here"):
        check_optimizer("c", torch.optim.AdamW(torch.nn.Linear(4, 9).parameters()), adam.state_dict())


# -- faults ----------------------------------------------------------------------


def test_fault_specs_parse_and_match_rank_and_restart() -> None:
    assert parse_faults("before_commit@20, after_step@5:rank=1:restart=any") == [
        Fault("before_commit", 20), Fault("after_step", 5, rank=1, restart=None),
    ]
    injector = FaultInjector(rank=1, restart=2, environ={"ELASTIC_FAULT": "after_step@5:rank=1"})
    injector.at("after_step", 5)  # restart 2: the default restart=0 fault does not fire
    assert parse_faults("after_step@7:do=stop,after_step@8:rank=2:do=hang") == [
        Fault("after_step", 7, action="stop"), Fault("after_step", 8, rank=2, action="hang"),
    ]
    for bad in ("explode@3", "after_step", "after_step@x", "after_step@3:color=red", "after_step@3:do=melt"):
        with pytest.raises(UsageError, match="ELASTIC_FAULT"):
            parse_faults(bad)
