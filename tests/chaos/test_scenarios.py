"""Every chaos scenario on a real two-agent job, for c10d and etcd-v3 rendezvous,
on loopback and with each agent on a host of its own (network namespaces).

Each asserts: the agents exit as expected (0, SIGKILL for the lost node, 75
when the disk is full), the job reaches its last step (or, on a full disk,
stops with its last good checkpoint intact and no temporary left), the final
checkpoint verifies, the fault was
followed by a restarted group that completed a step (its recovery time is
printed, never asserted), and the samples of the surviving history used every
sample of each epoch exactly once. Jobs with a constant world size must also
end with weights bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from etcd_server import EtcdServer
from support import flat_tensors, make_text

from elastic.chaos.harness import run_scenario
from elastic.chaos.netns import VirtualNetwork

pytestmark = pytest.mark.slow

STEPS = 40
CONSTANT_WORLD = {"kill-worker", "kill-during-save", "hang", "preemption", "etcd-restart", "soak", "slow-storage"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chaos-data") / "corpus.txt"
    path.write_text(make_text(random.Random(7), 40_000))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Callable[[int], dict[str, torch.Tensor]]:
    """Final weights of an uninterrupted two-agent run of N steps (each N run once)."""
    from elastic.chaos.harness import ChaosJob, JobSpec, verified_final_checkpoint

    runs: dict[int, dict[str, torch.Tensor]] = {}

    def weights(steps: int) -> dict[str, torch.Tensor]:
        if steps not in runs:
            workdir = tmp_path_factory.mktemp(f"reference-{steps}")
            spec = JobSpec(
                workdir=workdir, nnodes="2:2", run_id="reference",
                script_args=["--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir",
                             str(workdir / "ckpt"), "--ckpt-every", "5", "--dropout", "0.1", "--n-layer", "2",
                             "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8"],
            )
            with ChaosJob(spec) as job:
                job.start()
                assert job.wait(240) == [0, 0], job.logs()
            name, error = verified_final_checkpoint(workdir / "ckpt", steps)
            assert name, error
            runs[steps] = dict(flat_tensors(torch.load(workdir / "ckpt" / name / "model.pt", weights_only=True)))
        return runs[steps]

    return weights


def check(result, workdir: Path, reference: Callable[[int], dict[str, torch.Tensor]]) -> None:
    print(result.summary())
    assert result.ok, result.summary() + "\n" + result.logs
    assert result.report is not None and result.report.read_bytes()[:4] == b"\x89PNG", "the run's picture is missing"
    if result.scenario in CONSTANT_WORLD:
        want = reference(result.max_steps)
        got = dict(flat_tensors(torch.load(workdir / "ckpt" / result.final_checkpoint / "model.pt", weights_only=True)))
        different = [k for k in want if not torch.equal(want[k], got[k])]
        assert not different, f"{result.scenario}: {len(different)} tensors differ from the uninterrupted run"


@pytest.mark.parametrize(
    "scenario",
    ["kill-worker", "kill-during-save", "node-loss", "scale-up", "hang", "preemption", "soak", "disk-full", "slow-storage",
     "relaunch"],
)
def test_c10d(scenario: str, tmp_path: Path, corpus: Path, reference) -> None:
    steps = STEPS if scenario in CONSTANT_WORLD - {"soak"} else None  # the others train longer (SCENARIO_STEPS)
    check(run_scenario(scenario, tmp_path, corpus, steps=steps), tmp_path, reference)


@pytest.mark.parametrize(
    "scenario", ["kill-worker", "kill-during-save", "node-loss", "scale-up", "hang", "preemption", "relaunch"]
)
def test_etcd_v3(scenario: str, tmp_path: Path, corpus: Path, reference, shared_etcd: EtcdServer) -> None:
    steps = STEPS if scenario in CONSTANT_WORLD else None
    result = run_scenario(scenario, tmp_path, corpus, steps=steps, backend="etcd-v3", endpoint=shared_etcd.endpoint)
    check(result, tmp_path, reference)


def test_etcd_v3_restart_of_etcd_mid_recovery(tmp_path: Path, corpus: Path, reference, etcd: EtcdServer) -> None:
    """A worker is killed while etcd is down; etcd comes back and the agents regroup through it."""
    result = run_scenario("etcd-restart", tmp_path, corpus, steps=STEPS, backend="etcd-v3", etcd=etcd)
    check(result, tmp_path, reference)


@pytest.mark.parametrize("scenario", ["kill-worker", "partition"])
def test_c10d_on_separate_hosts(scenario: str, tmp_path: Path, corpus: Path, reference, network: VirtualNetwork) -> None:
    steps = STEPS if scenario in CONSTANT_WORLD else None
    check(run_scenario(scenario, tmp_path, corpus, steps=steps, network=network), tmp_path, reference)


def test_etcd_v3_partition_on_separate_hosts(tmp_path: Path, corpus: Path, reference, network: VirtualNetwork) -> None:
    """The cut-off host loses etcd too; it rejoins through etcd once its link is back."""
    with EtcdServer(tmp_path / "etcd-data", listen_hosts=("127.0.0.1", network.gateway)) as server:
        result = run_scenario("partition", tmp_path, corpus, backend="etcd-v3", etcd=server, network=network)
    check(result, tmp_path, reference)
