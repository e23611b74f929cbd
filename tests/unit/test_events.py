from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic._worker.observe.events import EventLog, read_events


def test_every_event_carries_the_contract_fields(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path, restart=2, clock=lambda: 123.5) as log:
        log.emit("start", step=0, world_size=3)
        log.emit("step", step=1, world_size=3, loss=4.5)
    assert list(read_events(path)) == [
        {"event": "start", "time": 123.5, "step": 0, "world_size": 3, "restart": 2},
        {"event": "step", "time": 123.5, "step": 1, "world_size": 3, "restart": 2, "loss": 4.5},
    ]


def test_a_restarted_job_appends_to_the_same_history(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "events.jsonl"
    for restart in range(3):
        with EventLog(path, restart=restart) as log:
            log.emit("start", step=restart * 10, world_size=2)
    assert [e["restart"] for e in read_events(path)] == [0, 1, 2]


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path, restart=0) as log:
        log.emit("step", step=1, world_size=1, loss=1.0)
    with open(path, "a") as f:
        f.write('{"event": "step", "ti')  # killed mid-write
    assert [e["step"] for e in read_events(path)] == [1]


def test_a_disabled_log_writes_nothing(tmp_path: Path) -> None:
    log = EventLog(None, restart=0)
    log.emit("step", step=1, world_size=1, loss=1.0)
    assert not log.enabled and list(tmp_path.iterdir()) == []


def test_unknown_event_kinds_are_refused(tmp_path: Path) -> None:
    with EventLog(tmp_path / "e.jsonl", restart=0) as log, pytest.raises(ValueError, match="unknown event"):
        log.emit("stepp", step=1, world_size=1)


def test_lines_are_compact_json(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    with EventLog(path, restart=0, clock=lambda: 1.0) as log:
        log.emit("end", step=5, world_size=1)
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["event"] == "end" and " " not in line


def test_a_fast_loops_step_lines_are_written_together_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic._worker.observe import events

    now = [100.0]
    monkeypatch.setattr(events, "monotonic", lambda: now[0])
    writes: list[bytes] = []
    real_write = events.os.write
    monkeypatch.setattr(events.os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    path = tmp_path / "events.jsonl"
    log = EventLog(path, restart=0)
    log.emit("step", step=1, world_size=1)  # the first line after a pause: written at once
    for step in (2, 3, 4):  # a fast loop: 10 ms apart, held back ...
        now[0] += 0.01
        log.emit("step", step=step, world_size=1)
    assert len(writes) == 1 and [e["step"] for e in read_events(path)] == [1]
    log.emit("checkpoint", step=4, world_size=1)  # ... until any other event: written after them
    assert len(writes) == 2
    for step in (5, 6, 7):  # ... or until the first held line is FLUSH_SECONDS old
        now[0] += 0.02
        log.emit("step", step=step, world_size=1)
    assert len(writes) == 2
    now[0] += 0.02
    log.emit("step", step=8, world_size=1)
    assert len(writes) == 3
    now[0] += 1.0  # a slow loop's line is written at once
    log.emit("step", step=9, world_size=1)
    assert len(writes) == 4
    now[0] += 0.01
    log.emit("step", step=10, world_size=1)
    log.close()  # ... and close writes what is held
    assert len(writes) == 5
    assert [(e["event"], e["step"]) for e in read_events(path)] == [
        ("step", 1), ("step", 2), ("step", 3), ("step", 4), ("checkpoint", 4), *(("step", s) for s in range(5, 11)),
    ]


def test_the_log_is_never_written_through_a_link_and_is_its_owners_alone(tmp_path: Path) -> None:
    """Probe (issue 55, L): the event log followed a link put in its place and was created world-readable."""
    import stat

    from elastic._shared.common.errors import UsageError

    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "linked.jsonl").symlink_to(target)
    with pytest.raises(UsageError, match="symbolic link"):
        EventLog(tmp_path / "linked.jsonl", restart=0)
    assert target.read_text() == ""
    log = EventLog(tmp_path / "events.jsonl", restart=0)
    log.close()
    assert stat.S_IMODE((tmp_path / "events.jsonl").stat().st_mode) == 0o600
