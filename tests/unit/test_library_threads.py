"""Clean exits: once `elastic.Run` closes, no library thread is left running (elastic._shared.common.threads),
and the registry's exit stops, joins, or ends the process without finalizing."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support import free_port
from torch.utils.data import TensorDataset

import elastic
from elastic._shared.common import threads
from elastic._worker.control.preemption import PreemptionHandler
from elastic._worker.runtime import context as runtime
from elastic._worker.runtime.context import WorkerContext

# Names of the threads the library starts (prefixes), whether or not through elastic._shared.common.threads.
LIBRARY_THREADS = (
    "elastic-", "checkpoint-", "snapshot-", "crc32c", "etcd-", "metrics",
)


def idle(thread: threading.Thread) -> bool:
    """A pool worker waiting for work on its queue: Python code, no torch call on its stack.
    (concurrent.futures joins these itself, before atexit.)"""
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is not None and frame.f_code.co_name == "_worker" and frame.f_code.co_filename.endswith(
        "concurrent/futures/thread.py"
    )


def left_running(before: set[threading.Thread]) -> list[str]:
    return sorted(
        t.name for t in threading.enumerate()
        if t not in before and t.is_alive() and t.name.startswith(LIBRARY_THREADS) and not idle(t)
    )


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process torchrun-like environment: Run makes (and destroys) a gloo group."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    yield
    runtime.shutdown_worker()  # whatever a failing test left up


def train(tmp_path: Path, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(40, 3, generator=generator), torch.randn(40, 1, generator=generator))
    with elastic.Run(seed=1, ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=2, hang_timeout=60, device="cpu") as run:
        model = run.ddp(torch.nn.Linear(3, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.start(model=model, optimizer=optimizer, data=dataset, batch_size=4)
        for batch in run.batches(max_steps=steps):
            x, y = dataset[batch]
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.log(loss)


def test_no_library_thread_runs_once_a_finished_run_closes(tmp_path: Path, launched: None) -> None:
    before = set(threading.enumerate())
    train(tmp_path, 5)
    assert not dist.is_initialized()
    assert [t.name for t in threads.alive() if t not in before] == []
    assert left_running(before) == []


def test_no_library_thread_runs_once_a_failed_run_closes(tmp_path: Path, launched: None) -> None:
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="the step failed"), elastic.Run(
        seed=1, ckpt_dir=str(tmp_path / "ckpt"), hang_timeout=60, device="cpu"
    ) as run:
        model = run.ddp(torch.nn.Linear(3, 1))
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=range(40), batch_size=4)
        raise ValueError("the step failed")
    # The group's teardown after a failure runs on a thread given a deadline; in one process it ends at once.
    teardown = [t for t in threads.alive() if t not in before and t.name == "elastic-group-teardown"]
    for thread in teardown:
        thread.join(timeout=30)
    assert left_running(before) == []


def test_the_preemption_watcher_is_joined_when_the_handler_is_uninstalled() -> None:
    ctx = WorkerContext(rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0, run_id="t",
                        device=torch.device("cpu"), backend=None)
    handler = PreemptionHandler(ctx)
    assert "elastic-sigterm-grace" in [t.name for t in threads.alive()]
    handler.uninstall()
    assert "elastic-sigterm-grace" not in [t.name for t in threads.alive()]


def test_stop_all_stops_each_thread_and_reports_those_that_outlive_the_bound() -> None:
    stopping = threading.Event()
    stuck = threading.Event()
    polite = threads.start(stopping.wait, name="elastic-test-polite", stop=stopping.set)
    deaf = threads.start(stuck.wait, name="elastic-test-deaf")  # no way to stop it: what a hung read is
    try:
        left = threads.stop_all(timeout=0.2)
        assert not polite.is_alive()
        assert left == [deaf]
    finally:
        stuck.set()
        deaf.join()


def test_the_exit_ends_the_process_with_the_noted_status_when_a_thread_outlives_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stuck = threading.Event()
    deaf = threads.start(stuck.wait, name="elastic-test-hung-read")
    exits: list[int] = []
    monkeypatch.setattr(threads, "EXIT_JOIN_SECONDS", 0.1)
    monkeypatch.setattr(threads.os, "_exit", exits.append)
    monkeypatch.setattr(threads, "_exit_status", None)
    try:
        threads.note_exit_status(75)
        threads._at_exit()
        assert exits == [75]
        stuck.set()
        deaf.join()
        threads._at_exit()  # nothing left: the interpreter finalizes as usual
        assert exits == [75]
    finally:
        stuck.set()


def test_a_free_port_for_a_test_server_lies_below_the_ephemeral_range_and_is_bindable() -> None:
    """Outgoing connections take their local ports from the ephemeral range: a port picked there could
    be taken before the server meant for it binds, and the test would wait for a server that never came."""
    import socket

    from elastic.chaos.netns import EPHEMERAL_RANGE

    from elastic._shared.slurm.step import RENDEZVOUS_PORT_BASE

    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(low // 2 <= p < low for p in ports), ports
    # ... and below the ports the runtime picks and holds itself (Slurm stores, each round's worker store):
    # a job beside this one could otherwise hold this one's rendezvous port, and no agent could serve it.
    assert all(p < RENDEZVOUS_PORT_BASE for p in ports), ports
    assert len(ports) > 1, "each pick is random"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_only_the_main_threads_sys_exit_is_the_status_a_stuck_exit_ends_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's sys.exit(0) ends that thread only: a crash after it must not end with status 0 (issue 40)."""
    monkeypatch.setattr(threads, "_exit_status", None)
    monkeypatch.setattr(threads, "_sys_exit_status", None)
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    other = threading.Thread(target=sys.exit, args=(0,))
    other.start()
    other.join()
    assert threads._intended_status() == 1, "a crash after another thread's sys.exit(0) is still a failure"
    with pytest.raises(SystemExit):
        sys.exit(3)
    assert threads._intended_status() == 3


def test_a_caught_sys_exit_never_turns_a_later_crash_into_its_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probe (issue 55, L): a script that caught its own sys.exit(0) and crashed later ended with status 0
    when a library thread outlived the exit. A crash after it is a crash; a library's own note still wins."""
    for name in ("_exit_status", "_sys_exit_status"):
        monkeypatch.setattr(threads, name, None)
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    try:
        sys.exit(0)
    except SystemExit:
        pass  # the script goes on
    assert threads._intended_status() == 0  # (it ends now: the status it chose)
    monkeypatch.setattr(sys, "last_value", RuntimeError("later"))  # what the interpreter sets for an uncaught crash
    assert threads._intended_status() == 1
    monkeypatch.setattr(sys, "last_value", KeyboardInterrupt())
    assert threads._intended_status() == 130
    threads.note_exit_status(75)  # the library's own decision on its way out (a restore that timed out)
    assert threads._intended_status() == 75
