"""Every chaos scenario on a real two-agent job, for c10d and etcd-v3 rendezvous,
on loopback and with each agent on a host of its own (network namespaces).

Faults that a job survives at the same world size share one job (a chain,
elastic.chaos.scenarios.parse_chain): each strikes once the job has recovered
from the one before, so one job start, one rendezvous and one reference run
serve several faults. Each job asserts: the agents exit as expected (0,
SIGKILL for a lost node, 75 when the disk is full), the job reaches its last
step (or, on a full disk, stops with its last good checkpoint intact and no
temporary left), the final checkpoint verifies, every fault was followed by a
restarted group that completed a step (its recovery time is printed, never
asserted), the samples of the surviving history used every sample of each
epoch exactly once, and (in-memory snapshots every step) a killed worker, a
killed snapshot, a lost node and a preemption each cost at most one finished
step. Jobs with a constant world size must also end with weights and optimizer
state bit-identical to an uninterrupted run's (tests/references.py). The kill
and the resize also run with the recipe's --fsdp (FSDP2: parameters and
optimizer state sharded, checkpoints saved in shards).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import warm
from etcd_server import EtcdServer
from references import REFERENCE_STEPS, References, gpt_args

from elastic._shared.storage.sharded import TENSORS_FILE
from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.observe.events import read_events
from elastic.chaos.netns import VirtualNetwork
from elastic.chaos.scenarios import run_scenario

pytestmark = pytest.mark.slow

STEPS = REFERENCE_STEPS
CONSTANT_WORLD = {"kill-worker", "kill-during-save", "kill-during-snapshot", "hang", "preemption", "etcd-restart", "soak", "slow-storage"}
FSDP = ["--fsdp"]


def run_warm(*args, **kwargs):
    """`run_scenario` with the agents forked warm (tests/warm.py)."""
    return run_scenario(*args, start_process=warm.popen, **kwargs)


def agent_logs(workdir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(workdir.glob("agent*.log")))


def check(result, workdir: Path, references: References, corpus: Path, recipe_args: tuple[str, ...] = ()) -> None:
    print(result.summary())
    assert result.ok, result.summary() + "\n" + result.logs
    assert result.report is not None and result.report.read_bytes()[:4] == b"\x89PNG", "the run's picture is missing"
    if set(result.scenario.split("+")) <= CONSTANT_WORLD:
        final = workdir / "ckpt" / result.final_checkpoint
        if "--fsdp" in recipe_args:  # saved in shards: each rank wrote its part of the sharded tensors
            chunks = json.loads((final / TENSORS_FILE).read_text())["chunks"]
            assert {c["file"] for c in chunks} == {"shard_00000.bin", "shard_00001.bin"}
            assert any(c["fqn"].startswith("model/") and c["at"] and c["at"][0] > 0 for c in chunks), "not sharded"
        assert result.max_steps == STEPS, "a constant-world job is compared with the shared reference run"
        want = references.tensors(gpt_args(corpus, STEPS, *recipe_args), STEPS)
        got = read_checkpoint(final)[1]
        assert want.keys() == got.keys(), f"{result.scenario}: other tensors than the uninterrupted run's"
        assert any(k.startswith("model/") for k in want) and any(k.startswith("optim/") for k in want)
        different = [k for k in sorted(want) if not torch.equal(want[k], got[k])]
        assert not different, (
            f"{result.scenario}: {len(different)} tensors differ from the uninterrupted run, e.g. {different[:3]}"
        )


def restores_after_faults(workdir: Path) -> list[dict]:
    """The restores after the job's first failure (by time: a survivor's agent that restarts its workers for
    the failed node's rejoin, not for a failure of its own, starts them at restart count 0)."""
    events = list(read_events(workdir / "events.jsonl"))
    first = min((e["time"] for e in events if e["event"] == "failure"), default=None)
    return [e for e in events if e["event"] == "restore" and first is not None and e["time"] > first]


def test_c10d_kill_term_and_stop_in_one_job(tmp_path: Path, shared_corpus: Path, references: References) -> None:
    """A SIGKILL, a SIGTERM (a preemption) and a SIGSTOP (a hang the watchdog ends) of random workers,
    each once the job has recovered from the one before: each costs at most one finished step and
    the job ends bit-identical to an uninterrupted one. The restart after the kill closed its round
    without its last call (both nodes were back), and the state came from memory, not the disk
    (the preemption's may come from the checkpoint it committed on the signal)."""
    result = run_warm("soak", tmp_path, shared_corpus, steps=STEPS)
    check(result, tmp_path, references, shared_corpus)
    assert len(result.recovery_seconds) == 3 and result.max_redone == 1
    # (After a node loss the round closes at whichever comes first, the lost node declared dead, about
    # 3 s after its last keep-alive, or the 2 s last call: a race by design. test_quick_rounds.py
    # checks the early close on a dead node without a last call to race.)
    assert "closes now: all" in agent_logs(tmp_path), result.logs
    sources = [e["source"] for e in restores_after_faults(tmp_path)]
    assert sources and sources[0] == "memory", f"the kill's restore was not from memory: {sources}"
    # The SIGSTOP (at a random moment, its peer left waiting in a collective) is named from its silence
    # before the watchdog's limit, on the agents and in the log, and its agent ends it (issue 42).
    hangs = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert len(hangs) == 1 and len(hangs[0]["culprits"]) == 1, hangs
    assert hangs[0]["reasons"][0].startswith("no answer") and hangs[0]["nodes"][0], hangs
    assert re.search(rf"ending worker rank {hangs[0]['culprits'][0]} \(pid \d+\), the hang's culprit",
                     agent_logs(tmp_path)), result.logs


def test_c10d_torn_snapshot_then_torn_save(tmp_path: Path, shared_corpus: Path, references: References) -> None:
    """Rank 1 killed while it copies step 15's snapshot (data written, header not), then rank 0 killed
    between writing step 20's checkpoint and committing it: neither torn copy is ever loaded (the
    restores come from memory, the part of step 15 that was torn excluded), and the job ends
    bit-identical to an uninterrupted one."""
    result = run_warm("kill-during-snapshot+kill-during-save", tmp_path, shared_corpus, steps=STEPS)
    check(result, tmp_path, references, shared_corpus)
    assert len(result.recovery_seconds) == 2, "both faults fired, each followed by a recovery"
    restores = restores_after_faults(tmp_path)
    assert restores and {e["source"] for e in restores} == {"memory"}, restores
    assert restores[0]["step"] < 15, "the snapshot torn at step 15 was loaded"


def test_c10d_a_lost_node_then_a_new_one_under_fsdp(tmp_path: Path, shared_corpus: Path, references: References) -> None:
    """A node lost (2 -> 1: its shared memory wiped, its ranks' parts come from the survivor's
    replica) and then a node that joins (1 -> 2), under --fsdp: each change reshards the model and
    optimizer state to the new world size. (The same chain without FSDP: test_etcd_v3.)"""
    recipe_args = tuple(FSDP)
    result = run_warm("node-loss+scale-up", tmp_path, shared_corpus, recipe_args=recipe_args)
    check(result, tmp_path, references, shared_corpus, recipe_args)
    assert result.exit_codes[1] == -9 and len(result.exit_codes) == 3
    restores = [(e["world_size"], e["saved_world_size"], e["source"])
                for e in read_events(tmp_path / "events.jsonl") if e["event"] == "restore"]
    shrunk = [r for r in restores if r[0] == 1 and r[1] == 2]
    assert shrunk and "peer" in {source for *_, source in shrunk}, f"the lost node's state did not come from its peer: {restores}"
    assert restores[-1][:2] == (2, 1), f"the job did not grow back to 2: {restores}"


def test_c10d_fsdp_kill_worker(tmp_path: Path, shared_corpus: Path, references: References) -> None:
    """The recipe with --fsdp: a killed worker resumes from sharded state at world size 2 and ends
    bit-identical to an uninterrupted FSDP run."""
    result = run_warm("kill-worker", tmp_path, shared_corpus, steps=STEPS, recipe_args=FSDP)
    check(result, tmp_path, references, shared_corpus, tuple(FSDP))
    restores = [(e["world_size"], e["saved_world_size"]) for e in read_events(tmp_path / "events.jsonl")
                if e["event"] == "restore"]
    assert restores and set(restores) == {(2, 2)}, restores


@pytest.mark.parametrize("scenario", ["disk-full", "slow-storage", "relaunch"])
def test_c10d_alone(scenario: str, tmp_path: Path, shared_corpus: Path, references: References) -> None:
    """The scenarios that need a job of their own: a full disk stops the job (exit 75, step 15's
    checkpoint intact), saves slower than every timeout trip nothing, and a job launched again with
    the same --rdzv-id resumes."""
    result = run_warm(scenario, tmp_path, shared_corpus, steps=STEPS if scenario == "slow-storage" else None)
    check(result, tmp_path, references, shared_corpus)


# With TORCHREVIVE_SURVIVORS=train-on the worker a fault did not hit keeps its process and trains on
# alone, restoring nothing (the restore events say "live"); the killed or stopped worker's replacement
# joins at a later step, a lost node's never comes. Not bit-identical (the world size changed): the
# sample audit proves every sample of each epoch was trained on once.
def test_c10d_survivors_train_on_through_a_kill_a_hang_and_a_lost_node(tmp_path: Path, shared_corpus: Path) -> None:
    result = run_warm("kill-worker+hang+node-loss", tmp_path, shared_corpus, steps=450, survivors="train-on")
    print(result.summary())
    assert result.ok and result.kept_processes >= 1, result.summary() + "\n" + result.logs
    events = list(read_events(tmp_path / "events.jsonl"))
    assert {e["source"] for e in events if e["event"] == "restore"} == {"live"}, "only live peers' state was taken"
    changes = [e["change"] for e in events if e["event"] == "heal"]
    # The kill and the hang each shrink the group and their replacement grows it back; the lost node's never comes.
    assert changes == ["shrink", "grow", "shrink", "grow", "shrink"], changes
    assert [e for e in events if e["event"] == "end"][0]["world_size"] == 1, changes


def test_cli_passes_fsdp_to_the_recipe(tmp_path: Path, shared_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m elastic.chaos --fsdp` runs each scenario with the recipe's --fsdp (and without it, without);
    a chain is one run."""
    import elastic.chaos.__main__ as cli
    from elastic.chaos.samples import SampleAudit

    calls: list[tuple[str, list[str]]] = []

    def fake_run(name: str, workdir: Path, data: Path, **kwargs):
        from elastic.chaos.verdict import ScenarioResult

        calls.append((name, list(kwargs["recipe_args"])))
        return ScenarioResult(name, [0, 0], [0, 0], 40, 40, [1.0], "step_00000040", None,
                              SampleAudit(1, 40, 40, 640, 0), "")

    monkeypatch.setattr(cli, "run_scenario", fake_run)
    common = ["--data", str(shared_corpus), "--workdir", str(tmp_path)]
    assert cli.main(["--scenario", "kill-worker", "--scenario", "node-loss", "--fsdp", *common]) == 0
    assert cli.main(["--scenario", "kill-worker", *common]) == 0
    assert cli.main(["--scenario", "node-loss+scale-up", *common]) == 0
    assert calls == [("kill-worker", FSDP), ("node-loss", FSDP), ("kill-worker", []), ("node-loss+scale-up", [])]


# The rendezvous of etcd-v3 in every kind of round: a restart round after a kill and after a preemption
# (one job: a job that ends on SIGTERM-committed state), a smaller round (a lost node) and a larger one
# (a node joining), and a relaunch that reopens a closed run. (A killed save and a hang take
# kill-worker's round: c10d covers their worker side.)
@pytest.mark.parametrize("scenario", ["kill-worker+preemption", "node-loss+scale-up", "relaunch"])
def test_etcd_v3(
    scenario: str, tmp_path: Path, shared_corpus: Path, references: References, shared_etcd: EtcdServer
) -> None:
    steps = STEPS if set(scenario.split("+")) <= CONSTANT_WORLD else None
    result = run_warm(scenario, tmp_path, shared_corpus, steps=steps, backend="etcd-v3", endpoint=shared_etcd.endpoint)
    check(result, tmp_path, references, shared_corpus)
    if scenario == "kill-worker+preemption":  # the restarts' rounds closed without their last call, woken by etcd watches
        assert "closes now: all 2 live nodes" in agent_logs(tmp_path), result.logs


def test_etcd_v3_restart_of_etcd_mid_recovery_through_the_cli(
    tmp_path: Path, shared_corpus: Path, references: References, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python -m elastic.chaos --scenario etcd-restart --backend etcd-v3`, as a user runs it: on an etcd
    of its own, a worker is killed while etcd is down; etcd comes back and the agents regroup through it.
    The CLI prints its verdict and leaves no etcd running."""
    import elastic.chaos.__main__ as cli

    results = []
    real_run = cli.run_scenario
    monkeypatch.setattr(cli, "run_scenario", lambda *args, **kwargs: results.append(real_run(*args, start_process=warm.popen, **kwargs)) or results[-1])
    assert cli.main(["--scenario", "etcd-restart", "--backend", "etcd-v3", "--data", str(shared_corpus),
                     "--workdir", str(tmp_path), "--steps", str(STEPS)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("etcd-restart: ok; exit codes [0, 0]")
    assert f"samples: each once (steps 1-{STEPS}" in out and "all 1 scenarios passed" in out
    assert (tmp_path / "etcd-restart" / "agent0.log").exists()
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _runs_in(p, tmp_path)], "etcd left running"
    check(results[0], tmp_path / "etcd-restart", references, shared_corpus)


def _runs_in(proc: Path, workdir: Path) -> bool:
    try:
        return str(workdir) in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_c10d_partition_on_separate_hosts(
    tmp_path: Path, shared_corpus: Path, references: References, network: VirtualNetwork
) -> None:
    """Each agent on a host of its own: a host cut off is lost, the job shrinks (its keepers'
    replicas crossed the links), and grows back once the link returns."""
    check(run_warm("partition", tmp_path, shared_corpus, network=network), tmp_path, references, shared_corpus)


def test_etcd_v3_partition_on_separate_hosts(
    tmp_path: Path, shared_corpus: Path, references: References, network: VirtualNetwork
) -> None:
    """The cut-off host loses etcd too; it rejoins through etcd once its link is back."""
    with EtcdServer(tmp_path / "etcd-data", listen_hosts=("127.0.0.1", network.gateway)) as server:
        result = run_warm("partition", tmp_path, shared_corpus, backend="etcd-v3", etcd=server, network=network)
    check(result, tmp_path, references, shared_corpus)
