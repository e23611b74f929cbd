"""Run history and the report: recoveries read from an event log, and the CLI's refusals."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic._shared.common.cli import run_main
from elastic.report import main as report_main
from elastic.report.history import recoveries, rounds


def event(kind: str, t: float, step: int, restart: int = 0, world: int = 2, **extra) -> dict:
    return {"event": kind, "time": t, "step": step, "world_size": world, "restart": restart, **extra}


def job_with_a_failure_a_resize_and_a_relaunch() -> list[dict]:
    return [
        event("start", 0.0, 0),
        *[event("step", 1.0 + i, i + 1, loss=3.0) for i in range(5)],  # steps 1-5 at t=1..5
        event("checkpoint", 4.2, 4, seconds=0.1, blocking_seconds=0.001),
        # worker killed; agent restarts (restart 1); an empty failed round first
        event("start", 7.0, 4, restart=1),
        event("restore", 8.5, 4, restart=1, seconds=0.2),
        event("start", 9.0, 4, restart=1),
        event("step", 9.5, 5, restart=1, loss=2.9),
        event("step", 10.0, 6, restart=1, loss=2.8),
        # a node leaves: same restart count, world size 1
        event("start", 12.0, 6, restart=1, world=1),
        event("step", 12.5, 7, restart=1, world=1, loss=2.7),
        # the whole job crashed, relaunched by a new torchrun later (count back to 0)
        event("start", 100.0, 7, restart=0),
        event("step", 101.0, 8, restart=0, loss=2.6),
        # a node joins: the agent SIGTERMs the healthy group (a preemption checkpoint), same count
        event("step", 101.05, 8, restart=0, loss=2.6),
        event("checkpoint", 101.06, 8, restart=0, seconds=0.1, blocking_seconds=0.05, reason="preemption"),
        event("start", 101.08, 8, restart=0, world=3),
        event("step", 101.09, 9, restart=0, world=3, loss=2.6),
        event("end", 101.1, 9, restart=0, world=3),
        # a second launch after a clean end is a new run, not a recovery
        event("start", 200.0, 8, restart=0),
        event("step", 201.0, 9, restart=0, loss=2.5),
        # SIGTERM: the step is committed, the agent restarts the group
        event("checkpoint", 201.2, 9, restart=0, seconds=0.1, blocking_seconds=0.05, reason="preemption"),
        event("start", 204.0, 9, restart=1),
        event("step", 205.0, 10, restart=1, loss=2.4),
    ]


def test_recoveries_span_last_step_to_first_step_and_name_their_cause() -> None:
    found = recoveries(job_with_a_failure_a_resize_and_a_relaunch())
    assert [(r.cause, r.seconds, r.restored_step, r.steps_redone) for r in found] == [
        ("failure", 9.5 - 5.0, 4, 1),
        ("membership change", 12.5 - 10.0, 6, 0),
        ("relaunch", 101.0 - 12.5, 7, 0),
        ("membership change", 101.09 - 101.05, 8, 0),
        ("preemption", 205.0 - 201.0, 9, 0),
    ]
    assert (found[1].world_size_before, found[1].world_size_after) == (2, 1)
    assert len(rounds(job_with_a_failure_a_resize_and_a_relaunch())) == 8


def write_log(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def binary_file(path: Path) -> Path:
    path.write_bytes(b"\xff\xfe\x00garbage")
    return path


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk comes first


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def report(capsys: pytest.CaptureFixture[str]) -> Callable[..., Done]:
    """`python -m elastic.report ARGS`, run in this process: its exit status and output."""

    def run(*args: str) -> Done:
        try:
            code = run_main(report_main, list(args))
        except SystemExit as exc:  # argparse's one-line refusals
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return Done(code, out, err)

    return run


def test_the_cli_draws_a_png_of_the_asked_size_and_prints_each_recovery(tmp_path: Path, report: Callable[..., Done]) -> None:
    set_aside = event("node_excluded", 10.5, 6, restart=1, node="n3", host="h3", reason="3 failures", failures=3)
    slow = [event("straggler", 3.0, 3, rank=1, node="n2", host="h2", slowdown=2.0),  # shaded on the picture
            event("straggler_recovered", 4.0, 4, rank=1, node="n2", host="h2", slowdown=1.02)]
    log = write_log(tmp_path / "job.jsonl", [*job_with_a_failure_a_resize_and_a_relaunch(), set_aside, *slow])
    result = report(str(log), "-o", str(tmp_path / "out" / "job.png"), "--width", "800", "--height", "600")
    assert result.returncode == 0, result.stderr
    assert "node set aside at step 6: n3 (host h3) after 3 failures: 3 failures" in result.stdout
    assert "nodes set aside: n3)" in result.stdout
    assert "straggler from step 3: rank 1 on node n2 (host h2), 2.00x the other ranks' work per sample" in result.stdout
    assert "straggler recovered at step 4: rank 1 on node n2 (host h2), 1.02x" in result.stdout
    assert png_size(tmp_path / "out" / "job.png") == (800, 600)
    assert "failure (restart 1): recovered in 4.5 s" in result.stdout
    assert "membership change (restart 1): recovered in 2.5 s, world size 2 -> 1" in result.stdout
    assert not list((tmp_path / "out").glob("*.tmp")), "written through a temporary and renamed"


def test_the_report_names_hangs_failures_a_node_set_aside_and_a_crash_loop() -> None:
    from elastic.report.incidents import incidents, set_aside

    noted = [
        event("hang", 6.0, 21, culprits=[1], nodes=["n2"], hosts=["h2"], collective="train step at step 21",
              stack_tops=["faults.py:120 in at"]),
        event("failure", 6.5, 7, rank=2, node="n3", host="h3", exitcode=-9, error="Signal 9 (SIGKILL)", primary=True),
        event("failure", 6.6, 7, rank=0, node="n1", host="h1", exitcode=1, error="Connection closed", primary=False),
        event("node_excluded", 7.0, 7, node="n3", host="h3", reason="node n3 is set aside: 3 failures", failures=3),
        event("crash_loop", 8.0, 14, rank=1, node="n2", error="ValueError: bad batch"),
        event("failure", 9.0, "x", rank=None, node=3),  # edited by hand: shown as "?"
    ]
    lines = incidents(noted)
    assert lines[0] == "hang at step 21 in train step at step 21: rank 1 on node n2 (stack top faults.py:120 in at)"
    assert lines[1].startswith("failure at step 7: rank 2 on node n3 (host h3), exit -9: Signal 9")
    assert lines[2].endswith("(a peer's failure reached it)")
    assert lines[3] == "node set aside at step 7: n3 (host h3) after 3 failures: node n3 is set aside: 3 failures"
    assert lines[4] == "crash loop stopped the job after step 14: rank 1 on node n2, ValueError: bad batch"
    assert lines[5].startswith("failure at step ?: rank ? on node ?")
    assert set_aside(noted) == {"n3": "node n3 is set aside: 3 failures"}


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d / "missing.jsonl", "no event log at"),
        (lambda d: write_log(d / "e.jsonl", [event("start", 0.0, 0)]), "holds no step events"),
        (lambda d: binary_file(d / "b.jsonl"), "not a JSON-lines event log"),
    ],
)
def test_a_bad_log_is_one_line_and_exit_2(tmp_path: Path, setup, message: str, report: Callable[..., Done]) -> None:
    result = report(str(setup(tmp_path)), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "x.png").exists()


def test_an_output_that_is_not_a_png_is_refused(tmp_path: Path, report: Callable[..., Done]) -> None:
    log = write_log(tmp_path / "job.jsonl", job_with_a_failure_a_resize_and_a_relaunch())
    result = report(str(log), "-o", str(tmp_path / "job.jpg"))
    assert result.returncode == 2 and "name the output *.png" in result.stderr


def test_without_matplotlib_the_text_is_the_report_and_one_line_says_no_picture(
    tmp_path: Path, report: Callable[..., Done], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's first command installs no matplotlib: the report's text needs none."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    log = write_log(tmp_path / "job.jsonl", job_with_a_failure_a_resize_and_a_relaunch())
    result = report(str(log))
    assert result.returncode == 0
    assert "failure (restart 1): recovered in 4.5 s" in result.stdout
    assert result.stderr.splitlines() == [
        "python -m elastic.report: no picture drawn: matplotlib is not installed (pip install 'torchrevive[report]')"]
    assert not (tmp_path / "job.png").exists()
    asked = report(str(log), "-o", str(tmp_path / "job.png"))  # a picture asked for by name: exit 2, text first
    assert asked.returncode == 2 and "failure (restart 1)" in asked.stdout
    assert asked.stderr.count("\n") == 1 and "matplotlib is not installed" in asked.stderr


def test_steps_redone_are_the_restore_events_count_when_it_gives_one() -> None:
    """The last step event before a kill lags the steps finished (the loss is read a step late, a kill cuts
    the line short): the restore event counts from each rank's own progress note."""
    log = job_with_a_failure_a_resize_and_a_relaunch()
    restore = next(e for e in log if e["event"] == "restore")
    assert recoveries(log)[0].steps_redone == 1  # 5 logged, 4 restored
    restore["redone"] = 2
    assert recoveries(log)[0].steps_redone == 2
    assert "resumed at step 4, 2 steps redone" in recoveries(log)[0].describe()
    restore["redone"] = "2"  # a hand-edited log: the step events' count
    assert recoveries(log)[0].steps_redone == 1
