"""A worker whose peer died leaves with one line that says so: no traceback, no preemption message, and an
exit status its agent never counts as a primary failure (elastic._worker.run.peer_loss).

In one process: the peer's death is the error a broken gloo collective raises. The job that kills one of
several workers of a node and reads the events is in tests/integration/test_documented_commands.py."""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import SimpleNamespace

import pytest
import torch

import elastic
from elastic._agent.launcher.failure_policy import is_collateral
from elastic._agent.launcher.job_watch import failure_of
from elastic._shared.common.cli import run_main
from elastic._shared.common.errors import PeerLost
from elastic._shared.protocol.exit_status import PEER_LOST_EXIT

BROKEN = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"


def train_until_a_peer_dies(tmp_path, *, sigterm_first: bool) -> None:
    with elastic.Run(device="cpu", ckpt_dir=str(tmp_path / "ckpt"), events=str(tmp_path / "ev.jsonl")) as run:
        model = torch.nn.Linear(2, 1)
        run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
        for _ in run.batches(max_steps=100):
            if run.step == 3:
                if sigterm_first:  # torchrun stopping the group: the SIGTERM comes before the broken collective
                    os.kill(os.getpid(), signal.SIGTERM)
                raise RuntimeError(BROKEN)


def test_a_collective_broken_by_a_peers_death_leaves_in_one_line_with_its_own_exit_status(
    tmp_path, capsys, caplog, monkeypatch
) -> None:
    caplog.set_level(logging.INFO)
    # The run's log lines to caplog only (another test's handler may hold a stream closed since): stderr is run_main's.
    monkeypatch.setattr(logging.getLogger(), "handlers", [caplog.handler])

    def main(_argv: list[str] | None) -> int:
        train_until_a_peer_dies(tmp_path, sigterm_first=True)
        return 0

    assert run_main(main) == PEER_LOST_EXIT
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "rank 0 stops: a peer worker died during step 4 (its collective broke: " in lines[0]
    assert "Connection closed by peer" in lines[0] and "restarts every worker" in lines[0]
    assert not [r for r in caplog.records if "received SIGTERM" in r.getMessage()], "no preemption message"


def test_other_errors_leave_as_they_came(tmp_path) -> None:
    with pytest.raises(ValueError, match="a bug"):
        with elastic.Run(device="cpu") as run:
            model = torch.nn.Linear(2, 1)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
            for _ in run.batches(max_steps=10):
                raise ValueError("a bug")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        with elastic.Run(device="cpu"):
            raise RuntimeError("CUDA out of memory")


def test_a_sigterm_the_job_acts_on_is_announced_once(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    with pytest.raises(elastic.Preempted):
        with elastic.Run(device="cpu", ckpt_dir=str(tmp_path / "ckpt")) as run:
            model = torch.nn.Linear(2, 1)
            run.start(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=16, batch_size=2)
            for _ in run.batches(max_steps=100):
                if run.step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
    said = [r.getMessage() for r in caplog.records if "received SIGTERM" in r.getMessage()]
    assert said == ["received SIGTERM: finishing this step, then checkpointing and exiting"]


def test_the_agent_counts_a_peers_death_as_the_peers() -> None:
    assert is_collateral(PEER_LOST_EXIT, f"exit status {PEER_LOST_EXIT}")
    # torch's record of a worker that ended through run_main: no error file, so no message of its own.
    record = SimpleNamespace(message="To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
                             exitcode=PEER_LOST_EXIT, local_rank=1)
    assert not failure_of(record, global_rank=1, notes=None, now=0.0).primary
    killed = SimpleNamespace(message="Signal 9 (SIGKILL) received by PID 12", exitcode=-9, local_rank=0)
    assert failure_of(killed, global_rank=0, notes=None, now=0.0).primary
    assert PeerLost.exit_code == PEER_LOST_EXIT and issubclass(PeerLost, elastic.ElasticError)


