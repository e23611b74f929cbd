"""`--slow-ranks evict` in one process: which rank is evicted and when (elastic._worker.observe.eviction),
what the evicted rank and its peers do at the vote, the setting's checks, and the agents' side (its
exit sets its node aside at once; under train-on the other nodes keep their workers)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic._agent.launcher import job_watch
from elastic._agent.launcher.failure_policy import Failure, decide
from elastic._agent.launcher.notice_board import Entry, LocalBoard
from elastic._shared.common.errors import UsageError
from elastic._shared.protocol import heal_env, worker_notes
from elastic._shared.protocol.exit_status import EVICTED_EXIT, FAULTY_NODE_EXIT
from elastic._worker.config import ArgumentParser, RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe import slow_ranks
from elastic._worker.observe.events import EventLog
from elastic._worker.observe.eviction import (
    EvictedError,
    Evictions,
    too_slow_to_rebalance,
)
from elastic._worker.observe.stragglers import StragglerWatch
from elastic._worker.runtime.context import WorkerContext


def watched(*votes: list[int], factor: float = 1.25, window: int = 3) -> StragglerWatch:
    watch = StragglerWatch(factor=factor, window=window)
    for figures in votes:
        watch.observe(figures)
    return watch


def test_a_rank_past_the_evict_factor_is_evicted_once_per_episode() -> None:
    evictions = Evictions(factor=3.0)
    slow = watched(*[[1000, 2000, 1000]] * 3)  # rank 1 a straggler at 2x: rebalanced, not evicted
    assert slow.slow == {1: 2.0} and evictions.observe(slow, (8, 8, 8), None) is None
    for _ in range(3):
        slow.observe([1000, 3500, 1000])
    found = evictions.observe(slow, (8, 8, 8), None)
    assert found is not None and found.rank == 1 and found.slowdown == 3.5 and "--evict-factor 3" in found.reason
    assert evictions.observe(slow, (8, 8, 8), None) is None  # once per episode
    for _ in range(3):
        slow.observe([1000, 1000, 1000])  # recovered
    assert not slow.slow and evictions.observe(slow, (8, 8, 8), None) is None
    for _ in range(3):
        slow.observe([1000, 4000, 1000])  # a new episode: evicted again
    assert evictions.observe(slow, (8, 8, 8), None).rank == 1  # type: ignore[union-attr]


def test_only_the_slowest_of_two_ranks_past_the_factor_is_evicted_per_vote() -> None:
    slow = watched(*[[5000, 1000, 6000, 1000, 1000]] * 3)
    found = Evictions(factor=3.0).observe(slow, (4,) * 5, None)
    assert found is not None and found.rank == 2


def test_a_straggler_at_the_smallest_share_that_still_sets_the_step_is_evicted_below_the_factor() -> None:
    assert too_slow_to_rebalance(1, (15, 1), (100.0, 2000.0))  # one sample of rank 1: 2000 > 15 x 100
    assert not too_slow_to_rebalance(1, (15, 1), (100.0, 1000.0))  # 1000 < 1500: the split still helps
    assert not too_slow_to_rebalance(1, (14, 2), (100.0, 2000.0))  # its share can shrink further
    slow = watched(*[[1000, 2000]] * 3)  # 2x: below the factor
    assert Evictions(factor=3.0).observe(slow, (8, 8), [1000.0, 2000.0]) is None
    found = Evictions(factor=3.0).observe(slow, (15, 1), [100.0, 2000.0])
    assert found is not None and found.rank == 1 and "share of one sample" in found.reason


def ranks_at_a_vote(tmp_path: Path, config: RunConfig) -> list[slow_ranks.SlowRanks]:
    """Two ranks' SlowRanks in one process, their places already gathered (no process group here)."""
    parts = []
    for rank in range(2):
        ctx = WorkerContext(rank=rank, local_rank=0, world_size=2, local_world_size=1, restart_count=0, run_id="t",
                            device=torch.device("cpu"), backend=None)
        events = EventLog(tmp_path / "events.jsonl" if rank == 0 else None, restart=0)
        part = slow_ranks.SlowRanks(ctx, config, events, torch.nn.Linear(2, 1),
                                    sampler=ElasticSampler(1000, batch_size=8, seed=0))
        part._places = [slow_ranks.Place("n0", "h0"), slow_ranks.Place("n1", "h1")]
        parts.append(part)
    return parts


def test_the_evicted_rank_leaves_at_the_vote_and_its_peer_trains_on(tmp_path: Path) -> None:
    rank0, rank1 = ranks_at_a_vote(tmp_path, RunConfig(slow_ranks="evict", slow_window=2))
    for step in (10, 20):
        assert rank0.verdict((1000, 4000), step, can_leave=True) is False  # evicted: no new shares
        if step == 10:
            rank1.verdict((1000, 4000), step, can_leave=True)  # the window is not full yet
    with pytest.raises(EvictedError, match="rank 1 .*node n1.* is evicted at step 20: 4.00x") as raised:
        rank1.verdict((1000, 4000), 20, can_leave=True)
    assert raised.value.exit_code == EVICTED_EXIT != FAULTY_NODE_EXIT
    import json
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    evicted = [e for e in events if e["event"] == "straggler_evicted"]
    assert len(evicted) == 1 and evicted[0]["rank"] == 1 and evicted[0]["action"] == "evicted"
    assert evicted[0]["node"] == "n1" and evicted[0]["step"] == 20 and evicted[0]["slowdown"] == 4.0
    assert not [e for e in events if e["event"] == "rebalance"]  # the group changes: no split for it


def test_without_train_on_evict_reports_the_rank_and_rebalances_it(tmp_path: Path) -> None:
    rank0, rank1 = ranks_at_a_vote(tmp_path, RunConfig(slow_ranks="evict", slow_window=2))
    for step in (10, 20):
        changed = [part.verdict((1000, 4000), step, can_leave=False) for part in (rank0, rank1)]
    assert changed == [True, True] and rank1.sampler.share(1, 2)[1] < 8  # type: ignore[union-attr]
    import json
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    kept = [e for e in events if e["event"] == "straggler_evicted"]
    assert len(kept) == 1 and kept[0]["action"] == "kept" and kept[0]["rank"] == 1
    assert [e["event"] for e in events].count("rebalance") == 1


def test_can_leave_needs_train_on_healing_and_the_minimum_without_the_node() -> None:
    def survivors(train_on: bool = True, heal: bool = True, local: int = 1, minimum: int = 2) -> Any:
        point = SimpleNamespace(local_world_size=local, min_world=minimum)
        return SimpleNamespace(train_on=train_on, can_heal=heal, healing=SimpleNamespace(point=point))

    assert slow_ranks.can_leave(survivors(), 3)
    assert not slow_ranks.can_leave(None, 3)  # not under torchrevive-run's survivors
    assert not slow_ranks.can_leave(survivors(train_on=False), 3)  # keep: the replacement would be as slow
    assert not slow_ranks.can_leave(survivors(heal=False), 3)
    assert not slow_ranks.can_leave(survivors(), 2)  # at the job's minimum
    assert not slow_ranks.can_leave(survivors(local=2, minimum=2), 3)  # its node takes two workers away


def test_the_evict_setting_is_checked_in_one_line(capsys: Any) -> None:
    assert RunConfig(slow_ranks="evict").evict_factor == 3.0
    with pytest.raises(UsageError, match=r"--evict-factor \(1.2\) must be above --slow-factor \(1.5\)"):
        RunConfig(slow_ranks="evict", evict_factor=1.2)
    RunConfig(slow_ranks="rebalance", evict_factor=1.2)  # not evicting: the factor is not read
    with pytest.raises(UsageError, match="evict_factor must be above 1"):
        RunConfig(evict_factor=0.5)
    with pytest.raises(SystemExit) as exited:
        ArgumentParser(prog="train.py").parse_args(["--evict-factor", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--evict-factor" in err[0]


def failure(node: str, exitcode: int, *, time: float = 100.0) -> Failure:
    return Failure(rank=1, node=node, host="h", exitcode=exitcode, step=40, error="evicted", time=time, primary=True)


def test_an_evicted_worker_sets_its_node_aside_at_once_where_the_job_can_shrink() -> None:
    decision = decide([failure("b", EVICTED_EXIT)], [], now=101.0, can_shrink=True, limit=3, window=600, attempts=3)
    assert decision.kind == "set_aside" and decision.node == "b"
    assert "evicted as a straggler (exit 82" in decision.line
    at_minimum = decide([failure("b", EVICTED_EXIT)], [], now=101.0, can_shrink=False, limit=3, window=600, attempts=3)
    assert at_minimum.kind == "restart"
    assert decide([failure("b", 1)], [], now=101.0, can_shrink=True, limit=3, window=600, attempts=3).kind == "restart"


def agent_environ(tmp_path: Path, node: str, survivors: str) -> dict[str, str]:
    """An agent's environment: its workers' notes directory (made), its node's name, the survivors' setting."""
    notes = tmp_path / "notes"
    notes.mkdir()
    return {worker_notes.NOTES_ENV: str(notes), "TORCHREVIVE_SNAPSHOT_NODE": node, heal_env.SURVIVORS_ENV: survivors}


@pytest.mark.parametrize("survivors", ["restart", "train-on"])
def test_a_node_set_aside_elsewhere_restarts_this_nodes_workers_only_without_train_on(
    tmp_path: Path, survivors: str
) -> None:
    environ = agent_environ(tmp_path, "node-a", survivors)
    restarted: list[Any] = []
    handler = SimpleNamespace(_settings=SimpleNamespace(min_nodes=2), get_run_id=lambda: "run")
    running = SimpleNamespace(spec=SimpleNamespace(local_world_size=1, rdzv_handler=handler, max_restarts=10),
                              group_world_size=3, workers=[SimpleNamespace(world_size=3)])
    board = LocalBoard()
    watch = job_watch.JobWatch(SimpleNamespace(_remaining_restarts=8, _restart_workers=restarted.append), running,
                               environ, board=board)
    board.post(Entry("node_excluded", "node node-b is set aside: evicted", 1.0, 40, 3, "node-b",
                     {"node": "node-b", "host": "h", "reason": "evicted", "failures": 3}))
    watch.look(running, SimpleNamespace(is_failed=lambda: False))
    assert watch.excluded == {"node-b"}
    # train-on: the survivors already formed a smaller group in their processes, as for a lost node
    assert restarted == ([] if survivors == "train-on" else [running])


def test_a_node_set_aside_under_train_on_marks_its_workers_failed_so_the_survivors_do_not_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastic._agent.launcher import in_place

    store = dist.HashStore()
    monkeypatch.setattr(in_place, "heal_store", lambda s: s)  # a TCP store in a job; any store here
    heals = in_place.InPlaceHeals({heal_env.SURVIVORS_ENV: "train-on"})
    heals.namespace, heals.generation = "run/1/host:29500", 2
    running = SimpleNamespace(store=store, workers=[SimpleNamespace(global_rank=3, world_size=4),
                                                   SimpleNamespace(global_rank=4, world_size=4)])
    key = heal_env.failed_key(heal_env.member_id(3, 2))
    monkeypatch.setenv(heal_env.SURVIVORS_ENV, "keep")
    in_place.mark_workers_failed(heals, running)
    assert in_place.records(store, heals.namespace, 4).get(key) is None  # only train-on's views read it
    monkeypatch.setenv(heal_env.SURVIVORS_ENV, "train-on")
    in_place.mark_workers_failed(heals, running)
    marked = in_place.records(store, heals.namespace, 4)
    assert marked.get(key) == "1" and marked.get(heal_env.failed_key(heal_env.member_id(4, 2))) == "1"


@pytest.mark.parametrize("survivors", ["restart", "train-on"])
def test_the_evicted_workers_agent_sets_its_node_aside_at_once_marking_it_failed_under_train_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, survivors: str
) -> None:
    from test_failure_policy import Process, failed, group

    from elastic._agent.launcher import in_place, set_aside_mark

    environ = agent_environ(tmp_path, "node-b", survivors)
    marked: list[Any] = []
    monkeypatch.setattr(in_place, "mark_workers_failed",
                        lambda agent, workers, env: marked.append(workers) if in_place.heal_env.mode(env) == "train-on"
                        else None)  # the real one's gate (tested above), on the environment it is handed
    monkeypatch.setattr(set_aside_mark, "_mark_path", lambda env: tmp_path / "mark.json")
    monkeypatch.setattr(job_watch, "_leave_rendezvous", lambda handler: None)
    monkeypatch.setenv("TORCHREVIVE_SNAPSHOT_NODE", "node-b")
    watch = job_watch.JobWatch(SimpleNamespace(_remaining_restarts=8), group(), environ, board=LocalBoard())
    running = group()
    with pytest.raises(job_watch.NodeSetAside, match="evicted as a straggler"):
        watch.look(running, failed((1, Process(0, EVICTED_EXIT, "", pid=321))))
    assert marked == ([running] if survivors == "train-on" else [])
