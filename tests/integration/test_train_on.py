"""Survivors train on (TORCHREVIVE_SURVIVORS=train-on): the GPT recipe, unchanged, under torchrevive-run.

A worker's death stops no other worker: the survivors form a smaller group at once and train on at
that world size, every sample of the epoch still once (the chaos suite's sample audit checks each
step's samples); the failed worker's replacement waits, and joins at a later vote step, taking the
state from a survivor's memory ("source": "live"). Nothing is read from disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import run_healing_job, workers_started

from elastic._shared.protocol import heal_env
from elastic.chaos.samples import audit, read_records

pytestmark = pytest.mark.slow

STEPS, KILL_AFTER = 60, 6


def run_job(tmp_path: Path, corpus: Path, agents: int, fault: str) -> tuple[list[dict], list[str]]:
    """The GPT recipe (sample-audited) on `agents` agents of one worker each with train-on and
    ELASTIC_FAULT=`fault`; its events and each agent's log."""
    return run_healing_job(tmp_path, corpus, agents, survivors=heal_env.TRAIN_ON, fault=fault, steps=STEPS,
                           nnodes=f"{agents - 1}:{agents}", ckpt_every=20, sample_log=tmp_path / "samples")


def survivors_kept_their_processes(prefix: Path, ranks: set[int]) -> None:
    """The workers that started as `ranks` trained in every group of the run (every round of the
    sample records), each in the one process it started with (the records carry the pid)."""
    records = read_records(prefix)
    first = min(records, key=lambda r: r["time"])["round"]
    pids = {r["pid"] for r in records if r["round"] == first and r["rank"] in ranks}
    assert len(pids) == len(ranks), pids
    rounds = {r["round"] for r in records}
    assert len(rounds) >= 3, "the first group, the survivors', and the grown one"
    for name in rounds:
        assert pids <= {r["pid"] for r in records if r["round"] == name}, "a survivor's process was replaced"


def test_survivors_train_on_while_the_replacement_starts_and_it_joins_later(tmp_path: Path, tiny_corpus: Path) -> None:
    """Three agents (--nnodes=2:3): rank 0, the event log's writer, SIGKILLed after step 6. Ranks 1 and
    2 keep their processes and train on at world size 2 (start rank 1 is their rank 0 and writes the
    log), and take rank 0's replacement in at a later step (it is rank 0 again and writes the grow's
    event); every step's samples are the sampler's, each once, and the job ends at world size 3 with
    equal weights everywhere. (A stopped worker and a lost node: tests/chaos/test_scenarios.py,
    test_c10d_survivors_train_on.)"""
    events, logs = run_job(tmp_path, tiny_corpus, 3, f"after_step@{KILL_AFTER}:rank=0")
    everything = "\n".join(log[-4000:] for log in logs)
    assert workers_started(logs) == {0: 2, 1: 1, 2: 1}, everything
    heals = [e for e in events if e["event"] == "heal"]
    assert [(e["change"], e["world_size"]) for e in heals] == [("shrink", 2), ("grow", 3)], heals
    assert heals[0]["step"] == KILL_AFTER
    # Phase by phase (elastic._worker.survivors.lifecycle): the survivors' shrink awaited the next view;
    # the replacement, rank 0 of the grown group, came in from its start by awaiting its admission.
    assert heals[0]["phases"][0] == "member", heals
    assert heals[0]["phases"][-5:] == ["leaving", "awaiting", "forming", "catching up", "member"], heals
    assert heals[1]["phases"] == ["starting", "awaiting", "forming", "catching up", "member"], heals
    # (Rank 0's last step lines before the kill may be lost with it: elastic._worker.observe.events.)
    sizes = {e["step"]: e["world_size"] for e in events if e["event"] == "step"}
    assert sizes[KILL_AFTER + 1] == 2 and sizes[STEPS] == 3, sizes
    restores = [e for e in events if e["event"] == "restore"]
    assert [e["source"] for e in restores] == ["live", "live"] and all(e["bytes_read"] == 0 for e in restores)
    assert restores[1]["bytes_received"] > 0, "the replacement took the state from a survivor"
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["step"] == STEPS and len(set(end["param_digests"])) == 1 and len(end["param_digests"]) == 3
    survivors_kept_their_processes(tmp_path / "samples", {1, 2})
    result = audit(tmp_path / "samples")
    assert result.ok and (result.first_step, result.last_step) == (1, STEPS), result.summary()


def test_a_replacement_killed_while_it_joins_is_replaced_again(tmp_path: Path, tiny_corpus: Path) -> None:
    """Three agents: rank 1 SIGKILLed after step 6, and its replacement SIGKILLed again while it takes
    the state at its admission (a second failure during the catch-up). The survivors fall back to the
    two of them, train on, and admit the second replacement later; exactly-once throughout."""
    events, logs = run_job(
        tmp_path, tiny_corpus, 3, f"after_step@{KILL_AFTER}:rank=1,during_catch_up@0+:rank=1:restart=1"
    )
    everything = "\n".join(log[-4000:] for log in logs)
    assert workers_started(logs) == {0: 1, 1: 3, 2: 1}, everything
    changes = [(e["change"], e["world_size"]) for e in events if e["event"] == "heal"]
    assert changes[0] == ("shrink", 2) and changes[-1] == ("grow", 3), changes
    assert all(e["source"] == "live" for e in events if e["event"] == "restore")
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["step"] == STEPS and len(set(end["param_digests"])) == 1 and len(end["param_digests"]) == 3
    survivors_kept_their_processes(tmp_path / "samples", {0, 2})
    result = audit(tmp_path / "samples")
    assert result.ok and (result.first_step, result.last_step) == (1, STEPS), result.summary()


def test_a_nodes_other_workers_leave_with_the_dead_one_and_their_replacements_join_in_step_with_the_evals(
    tmp_path: Path, tiny_corpus: Path
) -> None:
    """Two agents of two workers each, the recipe evaluating after every step (collectives between
    steps): start rank 3 SIGKILLed as step 7's gradient all-reduce starts. Its agent stops rank 2 too
    (its node-mate), and marks both failed before it does, so rank 2 never joins the survivors' group
    although it lived on for a moment. Ranks 0 and 1 train on at world size 2 (the void step 7 trained
    again without a second evaluation of step 6); the two replacements join later, each evaluating at
    the step it joined exactly as the members do (an eval is a collective: a worker that skipped it
    would hang the job), and the job ends at world size 4, every sample once."""
    events, logs = run_healing_job(
        tmp_path, tiny_corpus, 2, survivors=heal_env.TRAIN_ON, fault=f"during_all_reduce@{KILL_AFTER + 1}:rank=3",
        steps=100,
        nnodes="1:2", ckpt_every=20, sample_log=tmp_path / "samples", nproc_per_node=2, eval_every=1,
    )
    everything = "\n".join(log[-4000:] for log in logs)
    assert workers_started(logs) == {0: 1, 1: 1, 2: 2, 3: 2}, everything
    changes = [(e["change"], e["world_size"]) for e in events if e["event"] == "heal"]
    assert changes[0] == ("shrink", 2) and changes[-1][1] == 4, changes
    evals = [e["step"] for e in events if e["event"] == "eval"]
    assert evals == list(range(1, 101)), "one eval after every step (and at the end), joins and the heal included"
    (end,) = [e for e in events if e["event"] == "end"]
    assert end["world_size"] == 4 and len(set(end["param_digests"])) == 1, end
    survivors_kept_their_processes(tmp_path / "samples", {0, 1})
    result = audit(tmp_path / "samples")
    assert result.ok and (result.first_step, result.last_step) == (1, 100), result.summary()
