"""The agents' decisions from the job's failures: a bad node set aside, a crash loop stopped, a one-off
forgotten; the notice board every agent reads; the agent's watch over its workers (torch's records of
them and a store in this process)."""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from elastic._agent.launcher import hang_verdicts, job_entries, job_watch, set_aside_mark
from elastic._agent.launcher.failure_policy import (
    CRASH_LOOP_EXIT,
    SET_ASIDE_EXIT,
    Failure,
    NamedHang,
    Strike,
    bad_node,
    crash_loop,
    decide,
    first_line,
    is_collateral,
    strikes_of,
)
from elastic._agent.launcher.notice_board import (
    MAX_PER_READ,
    Entry,
    LocalBoard,
    StoreBoard,
)
from elastic._shared.protocol import round_identity, worker_notes
from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.storage.sealed_store import SealedStore
from elastic._shared.storage.store_records import MAX_VALUE


def failure(node: str, step: int, time: float, *, primary: bool = True, rank: int = 1) -> Failure:
    return Failure(rank=rank, node=node, host="h", exitcode=-9, step=step, error="Signal 9 (SIGKILL)", time=time,
                   primary=primary)


def test_a_node_failing_again_and_again_while_the_others_stay_healthy_is_set_aside() -> None:
    failures = [failure("b", 8 + n, 100.0 + n) for n in range(3)]
    failures += [failure("a", 9, 101.5, primary=False)]  # a peer's failure reached node a: no strike
    decision = decide(failures, [], now=103.0, can_shrink=True, limit=3, window=60, attempts=3)
    assert decision.kind == "set_aside" and decision.strikes == 3 and decision.node == "b"
    assert "node b is set aside: 3 failures of its workers" in decision.line
    # once it is out, its failures count no more: not towards a crash loop of the others (same step 8-10 or not)
    assert decide(failures, [], now=103.0, can_shrink=True, limit=3, window=60, attempts=3, excluded={"b"}).kind == "restart"
    same_step = [failure("b", 7, 100.0 + n) for n in range(3)]
    assert decide(same_step, [], now=103.0, can_shrink=True, limit=3, window=60, attempts=3).kind == "set_aside"
    assert decide(same_step, [], now=103.0, can_shrink=True, limit=3, window=60, attempts=3, excluded={"b"}) \
        .kind == "restart"


def test_a_one_off_elsewhere_does_not_shield_a_bad_node_and_excludes_no_one() -> None:
    one_off = [failure("a", 4, 90.0)]
    assert decide(one_off, [], now=91.0, can_shrink=True, limit=3, window=600, attempts=3).kind == "restart"
    history = one_off + [failure("b", 8 + n, 100.0 + n) for n in range(3)]
    assert decide(history, [], now=103.0, can_shrink=True, limit=3, window=600, attempts=3).node == "b"


def test_strikes_on_several_nodes_alike_set_no_one_aside() -> None:
    strikes = [Strike("a", 1.0, "failure"), Strike("b", 2.0, "failure"), Strike("a", 3.0, "failure"),
               Strike("b", 4.0, "failure"), Strike("a", 5.0, "failure"), Strike("b", 6.0, "failure")]
    assert bad_node(strikes, "a", 7.0, limit=3, window=60) is None
    assert bad_node(strikes, "a", 7.0, limit=0, window=60) is None  # off


def test_strikes_outside_the_window_are_forgotten_and_hangs_count() -> None:
    failures = [failure("b", 1, 10.0), failure("b", 2, 500.0)]
    hangs = [NamedHang("b", 510.0, since=505.0)]
    assert decide(failures, hangs, now=520.0, can_shrink=True, limit=3, window=100, attempts=3).kind == "restart"
    decision = decide(failures, hangs + [NamedHang("b", 515.0)], now=520.0, can_shrink=True, limit=3, window=100,
                      attempts=3)
    assert decision.kind == "set_aside" and "3 failures and hangs of its workers" in decision.line


def test_a_hang_whose_culprit_failed_while_it_lasted_is_one_strike_not_two() -> None:
    """Under train-on a stopped worker's agent ended it (the reaper: a primary failure) while the ranks still
    compared records; the verdict that came after named the same node for the same stall. Counted twice, with
    the kill before it, a healthy node was set aside (its third strike) and the job lost it."""
    failures = [failure("b", 21, 100.0), failure("b", 32, 161.0)]  # a kill; the frozen worker ended at 161
    same_stall = NamedHang("b", 162.5, since=159.8)
    assert decide(failures, [same_stall], now=163.0, can_shrink=True, limit=3, window=600, attempts=3).kind == "restart"
    posted_later = failures[:1] + [failure("b", 32, 165.0)]  # its agent's look came after the verdict
    assert decide(posted_later, [same_stall], now=166.0, can_shrink=True, limit=3, window=600, attempts=3).kind \
        == "restart"
    # a stall that began after the failure (another incident), or one of unknown start, is a strike of its own
    for hang in (NamedHang("b", 175.0, since=170.0), NamedHang("b", 162.5)):
        assert decide(failures, [hang], now=176.0, can_shrink=True, limit=3, window=600, attempts=3).kind \
            == "set_aside"
    # a failure of another node during the stall is no excuse for the node it named
    others = [failure("b", 21, 100.0), failure("a", 32, 161.0), failure("b", 40, 180.0)]
    assert [s.what for s in strikes_of(others, [same_stall])] == ["failure", "failure", "hang", "failure"]


def test_a_job_at_its_minimum_sets_no_one_aside_and_a_same_step_failure_stops_after_r_attempts() -> None:
    failures = [failure("b", 14, 100.0 + n) for n in range(2)]
    assert decide(failures, [], now=103, can_shrink=False, limit=3, window=60, attempts=3).kind == "restart"
    failures.append(failure("b", 14, 102.0))
    decision = decide(failures, [], now=103, can_shrink=False, limit=3, window=60, attempts=3)
    assert decision.kind == "stop" and decision.failure == failures[-1]
    assert "after step 14" in decision.line and "rank 1" in decision.line and "SIGKILL" in decision.line
    assert str(CRASH_LOOP_EXIT) in decision.line
    # a job that can shrink tries on without the node first
    assert decide(failures, [], now=103, can_shrink=True, limit=3, window=60, attempts=3).kind == "set_aside"


def test_a_crash_loop_needs_the_same_step_each_time_and_a_known_one() -> None:
    assert crash_loop([failure("a", s, 1.0) for s in (14, 14, 15)], attempts=3) is None  # it moved on
    assert crash_loop([failure("a", 14, 1.0), failure("a", 14, 2.0, primary=False), failure("a", 14, 3.0)],
                      attempts=3) is None  # a peer's collateral failure is not an attempt
    assert crash_loop([failure("a", -1, float(n)) for n in range(3)], attempts=3) is None  # unknown steps
    assert crash_loop([failure("a", 14, float(n)) for n in range(5)], attempts=0) is None  # off
    assert crash_loop([failure("a", 7, 1.0), *[failure("b", 14, float(n)) for n in range(3)]], attempts=3) is not None


def test_collateral_failures_read_as_a_peers() -> None:
    assert is_collateral(1, "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:5000")
    assert is_collateral(124, "")  # the watchdog of a stuck group; the hang verdict names the culprit
    assert is_collateral(-int(signal.SIGTERM), "")
    assert not is_collateral(-9, "Signal 9 (SIGKILL) received by PID 12")
    assert not is_collateral(1, "torch.OutOfMemoryError: CUDA out of memory")
    assert first_line("\n  ValueError: bad batch\nTraceback...") == "ValueError: bad batch"
    assert len(first_line("x" * 1000)) == 300 and first_line("a\x1bb") == "a?b"


def test_a_failure_from_the_board_is_checked_field_by_field() -> None:
    good = failure("a", 3, 1.0).to_json()
    assert Failure.parse(good) == failure("a", 3, 1.0)
    for bad in ({**good, "rank": "1"}, {**good, "step": -2}, {**good, "time": float("nan")}, {**good, "primary": 1},
                {**good, "error": "e" * 301}, {k: v for k, v in good.items() if k != "host"}, [good]):
        assert Failure.parse(bad) is None, bad


def entry(kind: str = "failure", line: str = "failure: worker rank 1 ...", **fields: Any) -> Entry:
    return Entry(kind, line, 1.0, 3, 2, "node-a", fields)


def sealed_store(secret: Path | None = None, launch: str = "a" * 32) -> SealedStore:
    """The store the rendezvous handler gives torch's agent (and the board): sealed in its launch's scope."""
    key = PeerKey.from_file(secret) if secret is not None else None
    inner = dist.HashStore()
    inner.set_timeout(timedelta(seconds=2))  # a read that would wait is a failure here, not a 300 s hang
    return SealedStore(inner, key, round_identity.rendezvous_scope("run", launch))


def test_the_board_in_a_store_reads_entries_in_order_once_and_checks_them() -> None:
    store = sealed_store()
    poster, reader = StoreBoard(store, "run", {}), StoreBoard(store, "run", {})
    numbers = [poster.post(entry(line=f"line {n}")) for n in range(3)]
    assert numbers == [1, 2, 3]
    assert [(n, e.line) for n, e in reader.read_new()] == [(1, "line 0"), (2, "line 1"), (3, "line 2")]
    assert reader.read_new() == []
    assert reader.claim(2) and not poster.claim(2)  # one agent writes each entry to the event log
    prefix = dist.PrefixStore("torchrevive/notices/run/", store)
    prefix.set("n4", json.dumps({**entry().__dict__, "kind": "reboot"}))  # an entry of another shape
    assert reader.read_new() == []  # skipped, with one warning
    assert poster.post(entry(line="late")) == 5
    assert [e.line for _, e in reader.read_new()] == ["late"]


def test_no_counter_a_stranger_moves_hides_a_later_notice(tmp_path: Path) -> None:
    """Probe (issue 55, M): one `add` to the board's unsealed `count` hid every later notice from every
    other agent, for good. The board has no counter now; a slot a stranger empties or forges is skipped."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    store = sealed_store(secret)
    env = {"TORCHREVIVE_SNAPSHOT_SECRET_FILE": str(secret)}
    poster, reader = StoreBoard(store, "run", env), StoreBoard(store, "run", env)
    raw = dist.PrefixStore("torchrevive/notices/run/", store.inner)
    raw.add("count", 1 << 40)  # what hid every later notice
    raw.set("n1", b"forged")  # a stranger's entry in the next slot: absent to the job
    assert poster.post(entry(line="first")) == 1  # the slot is taken over
    assert poster.post(entry(line="second")) == 2
    raw.delete_key("n1")  # a slot emptied after it was filled
    assert [e.line for _, e in reader.read_new()] == ["second"]
    assert reader.claim("crash_loop") and not poster.claim("crash_loop")
    raw.set("claimed/crash_loop", b"forged")  # a forged claim is no claim: the next to claim wins
    assert poster.claim("crash_loop")
    assert poster.acknowledge(7) == 1 and reader.acknowledge(7) == 2 and poster.acknowledged(7) == 2


def test_a_notice_of_another_launch_is_no_notice_of_this_one(tmp_path: Path) -> None:
    """Probe (issue 55, M): a crash-loop notice recorded from an earlier launch of the same run id and secret
    closed the next one. The board's values are sealed in their launch's scope."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    env = {"TORCHREVIVE_SNAPSHOT_SECRET_FILE": str(secret)}
    earlier = sealed_store(secret, launch="e" * 32)
    StoreBoard(earlier, "run", env).post(entry("crash_loop", "crash loop: the job failed 3 times"))
    now = sealed_store(secret)
    recorded = dist.PrefixStore("torchrevive/notices/run/", earlier.inner).get("n1")
    dist.PrefixStore("torchrevive/notices/run/", now.inner).set("n1", recorded)  # written into the next launch's store
    assert StoreBoard(now, "run", env).read_new() == []


def test_a_signed_board_ignores_what_the_secret_did_not_sign(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    store = dist.HashStore()
    signed = StoreBoard(store, "run", {"TORCHREVIVE_SNAPSHOT_SECRET_FILE": str(secret)})
    stranger = StoreBoard(store, "run", {})
    stranger.post(entry(line="forged"))
    signed.post(entry(line="real"))
    assert [e.line for _, e in signed.read_new()] == ["real"]


def test_a_long_entry_is_shortened_to_fit_and_reads_are_bounded() -> None:
    board = StoreBoard(sealed_store(), "run", {})
    board.post(entry(line="x" * 1400, stack_tops=["y" * 200] * 15))
    (_, read), = board.read_new()
    assert len(read.dumps()) <= MAX_VALUE and read.line.endswith("...")
    for n in range(MAX_PER_READ + 5):
        board.post(entry(line=str(n)))
    assert len(board.read_new()) == MAX_PER_READ and len(board.read_new()) == 5
    local = LocalBoard()
    local.post(entry())
    assert [n for n, _ in local.read_new()] == [1] and local.read_new() == [] and local.claim(1)


class Process:
    def __init__(self, local_rank: int, exitcode: int, message: Any, pid: int = 100) -> None:
        self.local_rank, self.exitcode, self.message, self.pid = local_rank, exitcode, message, pid


def group(nodes: int = 3, min_nodes: int = 2) -> Any:
    handler = SimpleNamespace(_settings=SimpleNamespace(min_nodes=min_nodes), get_run_id=lambda: "run")
    spec = SimpleNamespace(local_world_size=1, rdzv_handler=handler, max_restarts=10)
    return SimpleNamespace(spec=spec, group_world_size=nodes, workers=[SimpleNamespace(world_size=nodes)])


def failed(*processes: tuple[int, Process]) -> Any:
    return SimpleNamespace(is_failed=lambda: True, failures=dict(processes))


def watch(tmp_path: Path, node: str, board: Any, **env: str) -> job_watch.JobWatch:
    notes = tmp_path / node
    notes.mkdir()
    environ = {worker_notes.NOTES_ENV: str(notes), "TORCHREVIVE_SNAPSHOT_NODE": node, **env}
    now = [0.0]

    def sleep(seconds: float) -> None:  # the watch's bounded waits run on this clock
        now[0] += seconds

    return job_watch.JobWatch(SimpleNamespace(_remaining_restarts=8), group(), environ, board=board,
                              clock=lambda: now[0], sleep=sleep)


def test_the_agents_name_a_failure_write_it_once_and_set_the_bad_node_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    store = dist.HashStore()
    tmp_path.chmod(0o700)
    events = tmp_path / "events.jsonl"
    events.touch()
    healthy = watch(tmp_path, "node-a", StoreBoard(store, "run", {}))
    bad = watch(tmp_path, "node-b", StoreBoard(store, "run", {}), TORCHREVIVE_SET_ASIDE_COOL_OFF="60")
    worker_notes.note_events_path(healthy.notes, events)  # node a holds the event log
    monkeypatch.setattr(set_aside_mark, "_mark_path", lambda environ: tmp_path / "mark.json")
    left: list[Any] = []
    monkeypatch.setattr(job_watch, "_leave_rendezvous", left.append)
    note = worker_notes.ProgressNote(bad.notes, 0)
    for attempt in range(3):
        note.write(8 + attempt)
        monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_NODE", "node-b")
        result = failed((2, Process(0, -9, "", pid=200 + attempt)))
        if attempt < 2:
            bad.look(group(), result)
        else:
            with pytest.raises(job_watch.NodeSetAside) as raised:
                bad.look(group(), result)
        monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_NODE", "node-a")
        healthy.look(group(), failed((0, Process(0, 1, {"message": "RuntimeError: Connection closed by peer"}, 300 + attempt))))
    note.close()
    assert raised.value.exit_code == SET_ASIDE_EXIT and "node node-b is set aside: 3 failures" in raised.value.line
    assert "does not rejoin for 60 s" in raised.value.line and len(left) == 1
    written = [json.loads(line) for line in events.read_text().splitlines()]
    kinds = [e["event"] for e in written]
    assert kinds.count("failure") == 6 and kinds.count("node_excluded") == 1  # each once, though two agents read them
    first = next(e for e in written if e["event"] == "failure")
    assert (first["rank"], first["node"], first["step"], first["exitcode"], first["primary"]) == (2, "node-b", 8, -9, True)
    assert "Signal 9" in first["error"] or "SIGKILL" in first["error"]
    excluded = next(e for e in written if e["event"] == "node_excluded")
    assert (excluded["node"], excluded["failures"]) == ("node-b", 3) and excluded["reason"].startswith("node node-b")
    err = capsys.readouterr().err
    assert "torchrevive-run: failure: worker rank 2 on node node-b" in err and "killed by SIGKILL after step 8" in err
    assert "(a peer's failure reached it)" in err
    until = set_aside_mark.held_until({"TORCHREVIVE_SET_ASIDE_COOL_OFF": "60"}, run_id="run")
    assert until is not None and "set aside" in until[1]
    # the counts the workers' metrics serve: primary failures only, the node set aside
    assert worker_notes.read_incidents(healthy.notes) == {"job_failures": 3, "job_hangs_named": 0, "nodes_set_aside": 1}
    from elastic._worker.observe.metrics import AgentNotesCollector

    served = {f.name: f.samples[0] for f in AgentNotesCollector({"rank": "0", "run_id": "run"}, healthy.notes).collect()}
    assert served["torchrevive_job_failures"].value == 3 and served["torchrevive_nodes_set_aside"].value == 1
    assert served["torchrevive_job_failures"].labels == {"rank": "0", "run_id": "run"}
    worker_notes.incidents_path(healthy.notes).write_text('{"job_failures": "lots", "nodes_set_aside": -1}')
    assert set(worker_notes.read_incidents(healthy.notes).values()) == {0}


def test_a_crash_loop_stops_every_agent_with_its_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.HashStore()
    one, other = (watch(tmp_path, name, StoreBoard(store, "run", {})) for name in ("n1", "n2"))
    monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_NODE", "n1")
    note = worker_notes.ProgressNote(one.notes, 0)
    note.write(14)
    for attempt in range(3):
        at_minimum = group(nodes=2, min_nodes=2)
        result = failed((1, Process(0, 1, {"message": "ValueError: a batch that always fails"}, pid=attempt)))
        if attempt < 2:
            one.look(at_minimum, result)
        else:
            with pytest.raises(job_watch.CrashLoopStop) as raised:
                one.look(at_minimum, result)
    note.close()
    assert raised.value.exit_code == CRASH_LOOP_EXIT
    assert "after step 14" in raised.value.line and "ValueError: a batch that always fails" in raised.value.line
    with pytest.raises(job_watch.CrashLoopStop):  # the other agent reads it and stops too
        other.look(group(nodes=2, min_nodes=2), SimpleNamespace(is_failed=lambda: False))
    assert one.board.acknowledged(3 * 1 + 1) == 2  # both read the stop (the deciding agent waited for it)


def test_a_hang_note_becomes_one_entry_and_a_bad_note_none(tmp_path: Path) -> None:
    board = LocalBoard()
    agent_watch = watch(tmp_path, "n1", board)
    verdict = {"line": "hang: the job waits in train step at step 21 for rank 1", "step": 21, "culprits": [1],
               "nodes": ["n2"], "hosts": ["h"], "collective": "train step at step 21"}
    worker_notes.write_json(worker_notes.hang_path(agent_watch.notes, 0), verdict)
    agent_watch.look(group(), SimpleNamespace(is_failed=lambda: False))
    assert agent_watch.hangs and agent_watch.hangs[0].node == "n2"
    assert not worker_notes.hang_path(agent_watch.notes, 0).exists()
    worker_notes.write_json(worker_notes.hang_path(agent_watch.notes, 0), {**verdict, "culprits": ["1"]})
    agent_watch.look(group(), SimpleNamespace(is_failed=lambda: False))
    assert len(agent_watch.hangs) == 1


def test_notes_and_marks_are_bounded_and_checked(tmp_path: Path) -> None:
    assert worker_notes.read_progress(tmp_path, 0) is None
    worker_notes.progress_path(tmp_path, 0).write_bytes(b"x" * 16)
    assert worker_notes.read_progress(tmp_path, 0) is None  # not our magic
    big = tmp_path / "big"
    big.write_bytes(b"{" + b" " * worker_notes.MAX_NOTE + b"}")
    assert worker_notes.read_json(big) is None
    os.symlink(big, tmp_path / "link")
    assert worker_notes.read_json(tmp_path / "link") is None
    worker_notes.write_json(worker_notes.events_path_note(tmp_path), {"path": "relative/events"})
    assert worker_notes.read_events_path(tmp_path) is None
    worker_notes.note_events_path(tmp_path, tmp_path / "events.jsonl")
    assert worker_notes.read_events_path(tmp_path) == str(tmp_path / "events.jsonl")


def test_a_host_set_aside_waits_out_its_cool_off_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    tmp_path.chmod(0o700)
    monkeypatch.setattr(set_aside_mark, "_mark_path", lambda environ: tmp_path / "mark.json")
    slept: list[float] = []
    set_aside_mark.wait_out_cool_off({}, "run", sleep=slept.append)
    assert slept == []
    set_aside_mark.write({"TORCHREVIVE_SET_ASIDE_COOL_OFF": "30"}, "node n set aside", 30)
    set_aside_mark.wait_out_cool_off({"TORCHREVIVE_SET_ASIDE_COOL_OFF": "30"}, "run", sleep=slept.append)
    assert len(slept) == 1 and 0 < slept[0] <= 30
    assert "set aside from run run (node n set aside)" in capsys.readouterr().err
    (tmp_path / "mark.json").write_text(json.dumps({"until": "soon", "why": "x"}))
    assert set_aside_mark.held_until({}, run_id="run") is None
    set_aside_mark.write({}, "again", 30)
    tmp_path.chmod(0o777)  # a directory others may write: a mark there is not believed
    assert set_aside_mark.held_until({}, run_id="run") is None
    tmp_path.chmod(0o700)
    assert set_aside_mark.held_until({}, run_id="run") is not None


def test_a_node_set_aside_elsewhere_makes_this_healthy_node_start_a_round_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    board = LocalBoard()
    restarted: list[Any] = []
    healthy = watch(tmp_path, "node-a", board)
    healthy._agent = SimpleNamespace(_remaining_restarts=8, _restart_workers=restarted.append)
    board.post(Entry("node_excluded", "node node-b is set aside: 3 failures", 1.0, 8, 3, "node-b",
                     {"node": "node-b", "host": "h", "reason": "3 failures", "failures": 3}))
    running = group()
    healthy.look(running, SimpleNamespace(is_failed=lambda: False))
    assert restarted == [running] and healthy.excluded == {"node-b"}
    assert "start a new round without it" in capsys.readouterr().err
    healthy.look(running, SimpleNamespace(is_failed=lambda: False))
    assert len(restarted) == 1  # once


def test_this_nodes_worker_named_by_a_hang_is_ended_and_its_death_counts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    board = LocalBoard()
    agent = watch(tmp_path, "n1", board)
    agent.started_at = 100.0  # when the workers of its group started
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(job_watch.os, "kill", lambda pid, signum: killed.append((pid, signum)))
    running = group()
    running.workers = [SimpleNamespace(world_size=3, global_rank=1, id=4242),
                       SimpleNamespace(world_size=3, global_rank=2, id=4343)]
    hang = {"culprits": [1], "nodes": ["n1"], "collective": "train step at step 21"}
    board.post(Entry("hang", "hang: ... rank 1", 99.0, 21, 3, "n0", hang))  # an earlier group's: left alone
    agent.look(running, SimpleNamespace(is_failed=lambda: False))
    assert killed == []
    board.post(Entry("hang", "hang: ... rank 1", 101.0, 21, 3, "n0", hang))
    agent.look(running, SimpleNamespace(is_failed=lambda: False))
    assert killed == [(4242, signal.SIGKILL)]
    assert "ending worker rank 1 (pid 4242), the hang's culprit" in capsys.readouterr().err
    agent.look(running, failed((1, Process(0, -9, "", pid=4242))))
    assert [f.primary for f in agent.failures] == [False]  # the hang is its strike, not this death too
    assert [hang.node for hang in agent.hangs] == ["n1", "n1"]


def test_a_replacement_started_after_a_hangs_comparison_began_is_not_ended_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Under train-on a stopped culprit was ended and replaced (the reaper) while the hang's comparison ran;
    its verdict, posted after, ended the replacement too, a third strike that set the healthy node aside."""
    board = LocalBoard()
    agent = watch(tmp_path, "n1", board)
    agent.started_at = 100.0  # when the workers of its group started
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(job_watch.os, "kill", lambda pid, signum: killed.append((pid, signum)))
    monkeypatch.setattr(hang_verdicts, "started_at", {4242: 160.0, 4343: 120.0}.get)
    running = group()
    running.workers = [SimpleNamespace(world_size=3, global_rank=1, id=4242),
                       SimpleNamespace(world_size=3, global_rank=2, id=4343)]
    hang = {"culprits": [1, 2], "nodes": ["n1", "n1"], "collective": "train step at step 55", "since": 150.0}
    board.post(Entry("hang", "hang: ... ranks 1 and 2", 170.0, 55, 3, "n0", hang))
    agent.look(running, SimpleNamespace(is_failed=lambda: False))
    assert killed == [(4343, signal.SIGKILL)]  # rank 2 ran when the comparison began; rank 1 is a replacement
    assert "not ending worker rank 1 (pid 4242): it started after the hang was named" in capsys.readouterr().err
    assert {(hang.node, hang.since) for hang in agent.hangs} == {("n1", 150.0)}  # the stall's start, for the strikes
    note = {"line": "hang: x", "step": 55, "culprits": [1], "since": float("nan")}
    assert "since" not in job_entries.hang_entry(note, running).fields
    assert job_entries.hang_entry({**note, "since": 150.5}, running).fields["since"] == 150.5


def test_a_peers_failure_waits_for_its_own_entry_only_when_it_could_close_a_crash_loop(tmp_path: Path) -> None:
    board = StoreBoard(dist.HashStore(), "run", {})
    agent = watch(tmp_path, "n1", board)
    waited: list[float] = []
    advance = agent._sleep  # the watch's own clock moves as it sleeps

    def sleep(seconds: float) -> None:
        waited.append(seconds)
        advance(seconds)

    agent._sleep = sleep
    collateral = Process(0, 1, {"message": "RuntimeError: Connection closed by peer"}, pid=1)
    agent.look(group(), failed((0, collateral)))  # a lost node: no history, no entry will come
    assert waited == []
    for n in range(2):  # two failures after the same step: a third would close the loop
        board.post(Entry("failure", "f", 1.0, 14, 3, "n2", failure("n2", 14, float(n)).to_json()))
    agent.look(group(), SimpleNamespace(is_failed=lambda: False))  # read
    agent.look(group(), failed((0, Process(0, 1, {"message": "RuntimeError: Connection reset by peer"}, pid=2))))
    assert sum(waited) >= job_watch.PRIMARY_WAIT > sum(waited[:-1])  # it waited, bounded, for the primary's entry


@pytest.mark.parametrize("survivors", ["", "restart", "keep", "train-on"])
def test_a_group_a_worker_of_which_failed_is_stopped_with_sigkill_until_a_new_one_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, survivors: str
) -> None:
    """Under a restart on failure the stop of a broken group's workers is a SIGKILL: on SIGTERM they would
    compute on until their next collective fails. A failure of an earlier group, or a heal mode (the
    survivors heal and go on), leaves torch's SIGTERM."""
    board = LocalBoard()
    agent = watch(tmp_path, "n1", board, TORCHREVIVE_SURVIVORS=survivors)
    agent.started_at = 100.0  # when the workers of its group started
    healthy = SimpleNamespace(is_failed=lambda: False)
    board.post(Entry("failure", "failure: ...", 99.0, 20, 3, "n0", failure("n0", 20, 99.0).to_json()))
    agent.look(group(), healthy)
    assert agent.stop_signal() == signal.SIGTERM, "an earlier group's failure"
    board.post(Entry("failure", "failure: ...", 101.0, 21, 3, "n0", failure("n0", 21, 101.0).to_json()))
    agent.look(group(), healthy)
    broken = survivors in ("", "restart")
    assert agent.stop_signal() == (signal.SIGKILL if broken else signal.SIGTERM)
    agent.workers_started(group())
    assert agent.stop_signal() == signal.SIGTERM, "a new group is whole"
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(job_watch.os, "kill", lambda pid, signum: killed.append((pid, signum)))
    job_watch.end_now(SimpleNamespace(workers=[SimpleNamespace(global_rank=0, id=4242), SimpleNamespace(global_rank=1, id=None)]))
    assert killed == [(4242, signal.SIGKILL)], "a worker not started has no pid to end"


def test_a_script_that_fails_at_its_start_the_same_way_is_a_crash_loop() -> None:
    """With --max-restarts 100 by default, a script that raises before its first step (an import, its data)
    would start 100 times: the same error before a first step, three times, is a loop; a kill there is not."""
    def early(error: str, time: float, exitcode: int = 1) -> Failure:
        return Failure(rank=0, node="a", host="h", exitcode=exitcode, step=-1, error=error, time=time, primary=True)

    same = [early("exit status 1", float(n)) for n in range(3)]
    decision = decide(same, [], now=3.0, can_shrink=False, limit=3, window=60, attempts=3)
    assert decision.kind == "stop" and "3 times in a row before its first step, the same way" in decision.line
    assert crash_loop([early("ValueError: a", 1.0), early("ValueError: b", 2.0), early("ValueError: a", 3.0)],
                      attempts=3) is None  # not the same crash
    assert crash_loop([early("Signal 9 (SIGKILL)", float(n), exitcode=-9) for n in range(3)], attempts=3) is None
    assert crash_loop([early("exit status 1", 1.0), *[failure("a", 4, float(n)) for n in (2, 3)]], attempts=3) is None
