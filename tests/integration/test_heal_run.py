"""`elastic.Run` heals in place (elastic._worker.survivors.healing): the GPT recipe, unchanged, under torchrevive-run with
TORCHREVIVE_SURVIVORS=keep. A SIGKILLed worker's step is void on the survivors, who keep their
processes and their state; only the failed worker is started again, and it takes the state from a
survivor's memory ("source": "live"). Also: a second death, of that replacement while it catches up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from references import References
from support import (
    REPO,
    TINY_MODEL,
    free_port,
    healing_job_args,
    listens,
    run_healing_job,
    start_agents,
    torchrun_command,
    wait_all,
    worker_env,
    workers_started,
)

from elastic._shared.protocol import heal_env
from elastic._shared.storage.directory import CheckpointStore
from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

STEPS, KILL_AFTER = 16, 6


HEALED_PATH = ["leaving", "awaiting", "forming", "catching up", "member"]
"""How a survivor's heal ends, phase by phase (elastic._worker.survivors.lifecycle)."""


def run_job(
    tmp_path: Path, corpus: Path, agents: int, fault: str, eval_every: int = 0, **extra_env: str
) -> tuple[list[dict], list[str]]:
    """The GPT recipe on `agents` agents of one worker each with TORCHREVIVE_SURVIVORS=keep and
    ELASTIC_FAULT=`fault`; its events and each agent's log."""
    return run_healing_job(tmp_path, corpus, agents, survivors="keep", fault=fault, steps=STEPS,
                           nnodes=f"{agents}:{agents}", ckpt_every=5, eval_every=eval_every, **extra_env)


def final_position(ckpt: Path) -> tuple[int, int, int]:
    store = CheckpointStore(ckpt)
    manifest = store.verify(store.committed()[0])
    return manifest.step, manifest.epoch, manifest.consumed


@pytest.mark.parametrize("action", ["kill-in-eval", "stop"])
def test_survivors_keep_their_processes_and_the_run_ends_bit_identical(
    tmp_path: Path, shared_corpus: Path, references: References, action: str
) -> None:
    """Two agents: rank 1 SIGKILLed as the evaluation after step 6 starts (the recipe evaluates every 6
    steps: rank 0's evaluation all-reduce fails), or SIGSTOPped after step 6 (its agent ends it once it
    has been stopped TORCHREVIVE_FROZEN_WORKER_SECONDS). Rank 0 keeps its process, rank 1's replacement
    takes the state of step 6 from rank 0's memory, and the void step 7 is trained again: the final
    weights and optimizer state are bit for bit those of a run without the failure (and without
    evaluations: tests/references.py), and so is its data position."""
    fault = f"during_pause@{KILL_AFTER}:rank=1" if action == "kill-in-eval" else f"after_step@{KILL_AFTER}:rank=1:do=stop"
    healed, logs = run_job(tmp_path / "healed", shared_corpus, 2, fault, **{heal_env.FROZEN_AFTER_ENV: "1"},
                           eval_every=KILL_AFTER if action == "kill-in-eval" else 0)
    clean = references.final_checkpoint(healing_job_args(shared_corpus, STEPS), STEPS)
    everything = "\n".join(log[-3000:] for log in logs)
    if action == "stop":
        assert sum("has been stopped for" in log for log in logs) == 1, everything
    else:  # the evaluation the kill broke went on alone on rank 0; none ran twice (the replacement's neither)
        assert sum("a collective between steps failed" in log for log in logs) == 1, everything
        assert [e["step"] for e in healed if e["event"] == "eval"] == [KILL_AFTER, 2 * KILL_AFTER, STEPS]

    assert workers_started(logs) == {0: 1, 1: 2}, everything
    assert sum("replacing this node's workers in place (heal 1)" in log for log in logs) == 1, everything
    assert not any("Timed out" in log for log in logs), everything
    (restore,) = [e for e in healed if e["event"] == "restore"]
    assert (restore["source"], restore["step"], restore["source_rank"]) == ("live", KILL_AFTER, 0)
    assert restore["bytes_received"] > 0 and restore["bytes_read"] == 0, "nothing was read from disk"
    (heal,) = [e for e in healed if e["event"] == "heal"]
    assert (heal["step"], heal["generation"]) == (KILL_AFTER, 1)
    # The survivor's way through its lifecycle (a void step, or a step whose bookkeeping failed):
    assert heal["phases"][0] == "member" and heal["phases"][-5:] == HEALED_PATH, heal
    assert [e["step"] for e in healed if e["event"] == "step"] == list(range(1, STEPS + 1)), "no step lost or redone"
    # A save still being written when rank 1 died cannot commit (its part is gone): one line, and no more.
    assert all(e["step"] <= KILL_AFTER for e in healed if e["event"] == "checkpoint_failed")
    others = [e["event"] for e in healed if e["event"] not in ("step", "checkpoint", "checkpoint_failed", "failure", "eval")]
    assert others == ["start", "restore", "heal", "end"]
    # The failure, named once by the agent of its node (the worker could not write it).
    assert [e["rank"] for e in healed if e["event"] == "failure"] == [1]

    (healed_end,) = [e for e in healed if e["event"] == "end"]
    assert len(set(healed_end["param_digests"])) == 1, "the ranks ended with different weights"
    final = CheckpointStore(tmp_path / "healed" / "ckpt").committed()[0].path
    want, got = read_checkpoint(clean)[1], read_checkpoint(final)[1]
    assert want.keys() == got.keys() and any(key.startswith("optim/") for key in want)
    different = [key for key in sorted(want) if not torch.equal(want[key], got[key])]
    assert not different, f"the healed run ended elsewhere: {len(different)} tensors differ, e.g. {different[:3]}"
    assert final_position(tmp_path / "healed" / "ckpt") == final_position(clean.parent)


def test_a_replacement_that_dies_while_it_catches_up_is_replaced_again(tmp_path: Path, tiny_corpus: Path) -> None:
    """Three agents: rank 0 (the event writer) SIGKILLed after step 6, and its replacement SIGKILLed
    again while it takes the state. The survivors start the heal over with generation 2 and keep
    their processes; the second replacement takes step 6's state from rank 1, and the job trains
    every step once."""
    events, logs = run_job(
        tmp_path, tiny_corpus, 3, f"after_step@{KILL_AFTER}:rank=0,during_catch_up@{KILL_AFTER}:rank=0:restart=1"
    )
    everything = "\n".join(log[-3000:] for log in logs)

    assert workers_started(logs) == {0: 3, 1: 1, 2: 1}, everything
    assert sum("heal 1 broke" in log and "starting over" in log for log in logs) >= 1, everything
    assert any("in place (heal 2)" in log for log in logs), everything
    restores = [e for e in events if e["event"] == "restore"]
    assert [(e["source"], e["step"], e["source_rank"], e["restart"]) for e in restores] == [("live", KILL_AFTER, 1, 2)]
    # Rank 0 writes the events: its last step lines before the kill may be lost with it (elastic._worker.observe.events).
    stepped = [e["step"] for e in events if e["event"] == "step"]
    assert stepped == sorted(set(stepped)) and set(range(KILL_AFTER + 1, STEPS + 1)) <= set(stepped), stepped
    (end,) = [e for e in events if e["event"] == "end"]
    assert len(set(end["param_digests"])) == 1
    trained_on = int(re.search(r"training [0-9.]+M parameters on (\d+) samples", everything_whole(logs)).group(1))
    reference = ElasticSampler(trained_on, batch_size=8, seed=0)
    for _ in range(STEPS):
        reference.advance(3)
    assert final_position(tmp_path / "ckpt") == (STEPS, reference.state.epoch, reference.state.consumed), (
        "the final data position is not that of STEPS steps of 3 ranks: samples skipped or repeated"
    )


def everything_whole(logs: list[str]) -> str:
    return "\n".join(logs)


def test_a_lost_node_falls_back_to_a_new_round_of_the_nodes_left(tmp_path: Path, tiny_corpus: Path) -> None:
    """Three agents (--nnodes=2:3): an agent and its worker SIGKILLed at once (a lost node). No agent is
    left to start a replacement, so the survivors' heal never begins: after the bounded wait
    (`--heal-wait`, 2 s here) they exit with status 76, and the two agents left take a new round that
    restores and trains to the end."""
    import os
    import signal

    from support import stop_all, wait_for

    from elastic._agent.launcher.proctree import descendants

    events = tmp_path / "events.jsonl"
    port = free_port()
    command = torchrun_command(
        nnodes="2:3", port=port, run_id=tmp_path.name, max_restarts=3,
        script_args=[
            "--data", str(tiny_corpus), "--max-steps", "40", "--lr", "3e-3", "--dropout", "0",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "5", "--events", str(events),
            "--eval-every", "0", "--sample-tokens", "0", "--heal-wait", "2", *TINY_MODEL,
        ],
    )
    command[2] = "elastic._agent.launcher"
    env = worker_env(PYTHONPATH=str(REPO), **{heal_env.SURVIVORS_ENV: "keep"})
    agents = start_agents(3, command, tmp_path, env=env)
    try:
        # The first round may close with two of the three (its last call): wait for a step of all three.
        wait_for(lambda: any(e["event"] == "step" and e["step"] >= KILL_AFTER and e["world_size"] == 3
                             for e in read_events(events)) if events.exists() else False,
                 180, f"step {KILL_AFTER} at world size 3", interval=0.01)
        # Not the agent that serves the c10d store: without it there is no rendezvous at all (use etcd).
        lost = next(i for i, agent in enumerate(agents) if not listens(agent.pid, port))
        for pid in [agents[lost].pid, *descendants(agents[lost].pid)]:
            os.kill(pid, signal.SIGKILL)
    except BaseException:
        stop_all(agents)
        raise
    codes = wait_all(agents, timeout=300)
    logs = [(tmp_path / f"agent{i}.log").read_text(errors="replace") for i in range(3) if i != lost]
    everything = "\n".join(log[-4000:] for log in logs)
    assert codes[lost] == -signal.SIGKILL and codes[:lost] + codes[lost + 1:] == [0, 0], everything
    assert any("never began" in log for log in logs), everything
    records = list(read_events(events))
    (end,) = [e for e in records if e["event"] == "end"]
    assert (end["step"], end["world_size"]) == (40, 2), everything
    restores = [e for e in records if e["event"] == "restore" and e["world_size"] == 2]
    assert restores and restores[0]["source"] != "live", "the new round restored from a snapshot or the disk"
