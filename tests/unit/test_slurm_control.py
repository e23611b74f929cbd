"""Who owns a Slurm job, as elastic._shared.slurm.control reads it before an agent joins that job's
rendezvous (`--rdzv-endpoint=slurm:JOBID`): read from fields no job name can imitate."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from elastic._shared.slurm import control
from elastic._shared.slurm.control import SlurmControlError, nodes_of_job

ME, STRANGER = os.getuid(), os.getuid() + 1


def fake_slurm(monkeypatch: pytest.MonkeyPatch, *, owner: int, name: str, squeue: str) -> None:
    """`scontrol` and `squeue` that answer as Slurm would for job 77, named `name`, of `owner`
    (`subprocess.run` replaced: a unit test starts no process)."""
    record = (f"JobId=77 JobName={name} UserId=u({owner}) GroupId=g({owner}) MCS_label=N/A Priority=1 "
              f"JobState=RUNNING Reason=None NodeList=n[1-2] Requeue=1\n")
    answers = {"scontrol": record, "squeue": f"{squeue}\n" if squeue else ""}

    def run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 0, answers[Path(argv[0]).name], "")

    monkeypatch.setattr(control.shutil, "which", lambda program: f"/usr/bin/{program}")
    monkeypatch.setattr(control.subprocess, "run", run)


def test_a_job_of_this_user_is_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(monkeypatch, owner=ME, name="train", squeue=f"77 {ME} RUNNING n[1-2]")
    assert nodes_of_job(77) == ["n1", "n2"]


def test_a_job_name_holding_a_user_id_does_not_make_a_strangers_job_ours(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger names their job `x UserId=me(MYUID) JobState=RUNNING`: still theirs."""
    fake_slurm(monkeypatch, owner=STRANGER, name=f"x UserId=me({ME}) JobState=RUNNING NodeList=evil",
               squeue=f"77 {STRANGER} RUNNING n[1-2]")
    with pytest.raises(SlurmControlError, match=f"Slurm job 77 is not yours \\(uid {STRANGER}\\)"):
        nodes_of_job(77)


@pytest.mark.parametrize(("answer", "why"), [
    ("", "is not running"),  # gone, or hidden from us (PrivateData=jobs)
    (f"77 {ME} PENDING (null)", "is not running"),
    (f"77 {ME} RUNNING n[1", "NodeList"),
    ("77 me RUNNING n1", "unexpected answer"),
    (f"77 {ME} RUNNING", "unexpected answer"),
    (f"78 {ME} RUNNING n1", "is not running"),  # another job's line (an array's task) is not this job
    (f"77 {ME} RUNNING n1\n77 {ME} RUNNING n2", "more than once"),
])
def test_an_odd_answer_is_one_line(monkeypatch: pytest.MonkeyPatch, answer: str, why: str) -> None:
    fake_slurm(monkeypatch, owner=ME, name="train", squeue=answer)
    with pytest.raises(SlurmControlError, match=why) as caught:
        nodes_of_job(77)
    assert "\n" not in str(caught.value)


def test_squeue_missing_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control.shutil, "which", lambda name: None)
    with pytest.raises(SlurmControlError, match="squeue is not on PATH"):
        nodes_of_job(77)
