"""The Hugging Face recipes on real two-agent jobs under torchrevive-run: a worker SIGKILLed at a
random step ends with weights and optimizer state bit-identical to an uninterrupted run's, and a job
that loses a node and gains one back (2 -> 1 -> 2) trains every sample of each epoch exactly once
(the sample audit of elastic.chaos.samples, which both recipes pass through `Run`)."""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import warm

pytest.importorskip("transformers")
from references import References  # noqa: E402
from support import REPO  # noqa: E402

from elastic._worker.checkpoint import read_checkpoint  # noqa: E402
from elastic.chaos.harness import ChaosJob  # noqa: E402
from elastic.chaos.job_spec import JobSpec  # noqa: E402
from elastic.chaos.samples import audit  # noqa: E402
from elastic.chaos.scenarios import run_scenario  # noqa: E402
from elastic.chaos.verdict import verified_final_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

RECIPES = {"trainer": REPO / "recipes" / "hf_trainer.py", "accelerate": REPO / "recipes" / "hf_accelerate.py"}
# bf16 autocast on both; the Trainer's steps split into two micro-batches (DDP's no_sync on the first).
RECIPE_ARGS = {"trainer": ("--bf16", "--grad-accum", "2"), "accelerate": ("--bf16",)}
MODEL = ("--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8")
STEPS = 30


def run_warm(*args, **kwargs):
    """`run_scenario` with the agents forked warm (tests/warm.py)."""
    return run_scenario(*args, start_process=warm.popen, **kwargs)


@pytest.fixture(scope="module")
def corpus(shared_corpus: Path) -> Path:
    return shared_corpus


def common_args(corpus: Path, ckpt: Path, steps: int) -> list[str]:
    return ["--data", str(corpus), "--max-steps", str(steps), "--eval-every", "0", "--ckpt-dir", str(ckpt),
            "--ckpt-every", "5", "--dropout", "0.1", "--output-dir", str(ckpt.parent / "model"), *MODEL]


def uninterrupted(recipe: str, references: References, corpus: Path) -> dict[str, torch.Tensor]:
    """The final tensors of an uninterrupted two-rank run of `recipe` (tests/references.py)."""
    args = ["--data", str(corpus), "--max-steps", str(STEPS), "--eval-every", "0", "--dropout", "0.1",
            "--output-dir", "{workdir}/model", *MODEL, *RECIPE_ARGS[recipe]]
    return references.tensors(args, STEPS, script=RECIPES[recipe])


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_worker_killed_at_a_random_step_ends_bit_identical(
    recipe: str, tmp_path: Path, corpus: Path, references: References
) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    result = run_warm(
        "kill-worker", tmp_path / "killed", corpus, steps=STEPS, seed=seed, recipe=RECIPES[recipe],
        model_args=MODEL, recipe_args=("--output-dir", str(tmp_path / "killed" / "model"), *RECIPE_ARGS[recipe]),
    )
    print(result.summary())
    assert result.ok, result.summary() + "\n" + result.logs
    want = uninterrupted(recipe, references, corpus)
    got = read_checkpoint(tmp_path / "killed" / "ckpt" / result.final_checkpoint)[1]
    assert want.keys() == got.keys() and any(k.startswith("optim/") for k in want)
    different = [k for k in sorted(want) if not torch.equal(want[k], got[k])]
    assert not different, f"{len(different)} tensors differ from the uninterrupted run, e.g. {different[:3]}"
    assert (tmp_path / "killed" / "model" / "config.json").is_file(), "no Hugging Face model folder at the end"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_resize_2_1_2_trains_every_sample_exactly_once(recipe: str, tmp_path: Path, corpus: Path) -> None:
    steps = 200
    spec = JobSpec(
        workdir=tmp_path, nnodes="1:3", run_id=f"hf-resize-{recipe}", script=RECIPES[recipe],
        script_args=[*common_args(corpus, tmp_path / "ckpt", steps), "--hang-timeout", "10"],
        sample_log=tmp_path / "samples",
        # Rank 0 paces every step (>= 0.3 s) while it trains alone, so the job outlasts the node
        # that joins back (it imports torch and transformers first); at world size 2 it runs at full speed.
        env={"ELASTIC_FAULT": "after_step@1+:do=slow:for=0.3:restart=any:world=1"}, start_process=warm.popen,
    )
    with ChaosJob(spec) as job:
        job.start()
        job.wait_for_world_size(2, after=0.0)
        job.wait_for_step(random.randint(8, 14))
        job.kill_agent(1)  # not agent 0: it hosts c10d's rendezvous store
        job.wait_for_world_size(1, after=job.faults[-1][1])
        rejoined = time.time()
        job.add_agent(host=1)
        job.wait_for_world_size(2, after=rejoined)
        codes = job.wait(240)
        assert codes[0] == 0 and codes[1] == -signal.SIGKILL and codes[2] == 0, job.logs()
    name, error = verified_final_checkpoint(tmp_path / "ckpt", steps)
    assert name, error
    samples = audit(tmp_path / "samples")
    print(samples.summary())
    assert samples.ok, samples.summary()
    assert samples.last_step == steps
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
