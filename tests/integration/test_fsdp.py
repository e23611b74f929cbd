"""The GPT recipe with --fsdp (FSDP2) in real torchrun jobs on CPU (gloo): a killed
worker's job ends bit-identical to an uninterrupted one, a job saved at 2 ranks
resumes at 3 and at 1 with its model and optimizer resharded and every sample
used once, a restore reads each byte of the checkpoint once (DDP and FSDP), and
a wrapper the runtime cannot checkpoint is refused in one line."""

from __future__ import annotations

import random
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import warm
from references import REFERENCE_STEPS, References, gpt_args
from support import (
    GPT_RECIPE,
    REPO,
    TINY_MODEL,
    free_port,
    make_text,
    standalone_command,
    worker_env,
)
from text_data import split_corpus

from elastic._shared.storage.sharded import SHARD_PREFIX
from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.observe.events import read_events
from elastic.chaos.samples import audit

pytestmark = pytest.mark.slow

QUIET = ["--eval-every", "0", "--sample-tokens", "0"]

# Runs the recipe given as its first argument under the sample recorder
# (elastic.chaos.samples); once `Run.start` has restored, every rank gathers the
# live model and optimizer state whole (by the checkpoint's keys) and rank 0 saves
# it to $PROBE_OUT: what the resumed job trains on, at its world size. Training
# then goes on as usual (the gathers touch no state).
PROBE = textwrap.dedent("""
    import os, runpy, sys

    import torch
    from torch.distributed.tensor import DTensor

    import elastic
    from elastic._worker.checkpoint.state import live_tensors

    original_start = elastic.Run.start

    def start(self, *, model, optimizer, **kwargs):
        step = original_start(self, model=model, optimizer=optimizer, **kwargs)
        live = live_tensors(model, optimizer)
        whole = {}
        for key in sorted(live):  # gathers: the same order on every rank
            value = live[key].full_tensor() if isinstance(live[key], DTensor) else live[key]
            whole[key] = value.detach().cpu().clone()
        if self.is_main:
            sharded = sorted(key for key, value in live.items() if isinstance(value, DTensor))
            torch.save({"step": step, "sharded": sharded, "tensors": whole}, os.environ["PROBE_OUT"])
        return step

    elastic.Run.start = start
    sys.argv = ["elastic.chaos.samples", *sys.argv[1:]]
    runpy.run_module("elastic.chaos.samples", run_name="__main__", alter_sys=True)
""")


def run_job(
    nproc: int, args: list[str], *, max_restarts: int = 0, timeout: float = 240, record_samples: bool = False,
    script: Path | None = None, **env: str,
) -> None:
    """One standalone torchrun job of `nproc` workers on the GPT recipe (or `script`); it must exit 0."""
    command = standalone_command(nproc, args, max_restarts=max_restarts, record_samples=record_samples)
    if script is not None:  # it runs the recipe
        at = command.index(str(GPT_RECIPE))
        command[at:at] = [str(script)]
    done = warm.run(command, timeout=timeout, cwd=REPO, env=worker_env(**env))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def events_of(path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(path) if e["event"] == kind]


def assert_same(want: Any, got: Any, where: str = "") -> None:
    """Equal nested states: tensors bit for bit (dtype and shape included), the rest by ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got), f"{where} differs"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and want.keys() == got.keys(), f"{where}: other keys"
        for key in want:
            assert_same(want[key], got[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(want) == len(got), f"{where}: other length"
        for i, (a, b) in enumerate(zip(want, got)):
            assert_same(a, b, f"{where}/{i}")
    else:
        assert want == got, f"{where}: {want!r} != {got!r}"


def assert_same_tensors(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], why: str) -> None:
    assert want.keys() == got.keys(), f"other tensors {why}: {sorted(want.keys() ^ got.keys())[:5]}"
    different = [k for k in sorted(want) if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]
    assert not different, f"{len(different)} of {len(want)} tensors differ {why}, e.g. {different[:3]}"


def shard_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.glob(SHARD_PREFIX + "*"))


# -- (a) a killed worker, same world size: bit-identical -----------------------------------------------------


def test_fsdp_job_killed_midway_ends_bit_identical_to_an_uninterrupted_one(
    tmp_path: Path, shared_corpus: Path, references: References
) -> None:
    """Under plain torchrun (every worker restarted, no snapshots: the restore reads the sharded
    checkpoint from disk), against the uninterrupted FSDP run of tests/references.py."""
    steps = REFERENCE_STEPS
    faulty = tmp_path / "faulty"
    # Rank 0 (the committing rank) dies after step 7: step 3's checkpoint is committed, step 6's may be.
    run_job(
        2,
        [*gpt_args(shared_corpus, steps, "--fsdp"), "--ckpt-dir", str(faulty / "ckpt"), "--ckpt-every", "3",
         "--events", str(faulty / "events.jsonl")],
        max_restarts=1, ELASTIC_FAULT="after_step@7",
    )
    clean = references.final_checkpoint(gpt_args(shared_corpus, steps, "--fsdp"), steps)

    restores = events_of(faulty / "events.jsonl", "restore")
    assert [(e["world_size"], e["saved_world_size"]) for e in restores] == [(2, 2)], restores
    assert restores[0]["step"] in (3, 6), "resumed from a checkpoint before the kill"

    _, want, want_trainer = read_checkpoint(clean)
    manifest, got, got_trainer = read_checkpoint(faulty / "ckpt" / f"step_{steps:08d}")
    assert manifest.world_size == 2
    assert any(k.startswith("model/") for k in want) and any(k.startswith("optim/") for k in want)
    assert_same_tensors(want, got, f"after the kill (resumed from step {restores[0]['step']})")
    assert_same(want_trainer, got_trainer, "trainer")  # sampler, schedule, every rank's RNG, optimizer settings


# -- (b) resize: saved at 2 ranks, resumed at 3 and at 1 ----------------------------------------------------


def test_fsdp_job_resumes_at_3_and_1_ranks_resharded_with_every_sample_once(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(make_text(random.Random(5), 4_000))
    train_set, _ = split_corpus(corpus.read_bytes(), block_size=32)
    n, batch = len(train_set), 4
    steps_w2, steps_w3 = 3, 3
    remaining = n - steps_w2 * batch * 2 - steps_w3 * batch * 3
    assert remaining > 0
    total_steps = steps_w2 + steps_w3 + -(-remaining // batch)  # the W=1 run reaches the end of epoch 0
    ckpt, events, log_prefix = tmp_path / "ckpt", tmp_path / "events.jsonl", tmp_path / "samples"
    common = [
        "--data", str(corpus), "--ckpt-dir", str(ckpt), "--ckpt-every", "0", "--events", str(events),
        "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", str(batch),
        "--fsdp", *QUIET,
    ]
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)

    def resume(world: int, from_step: int, until: int) -> None:
        """Train at `world` ranks from the checkpoint of `from_step` (saved at another
        world size); the live model and optimizer it restored, gathered whole, must be
        the saved ones, bit for bit."""
        out = tmp_path / f"restored-w{world}.pt"
        run_job(world, [*common, "--max-steps", str(until)], script=probe, PROBE_OUT=str(out),
                ELASTIC_SAMPLE_LOG=str(log_prefix))
        restored = torch.load(out, weights_only=True)
        assert restored["step"] == from_step
        if world > 1:
            assert any(k.startswith("optim/") for k in restored["sharded"]), "the optimizer state is not sharded"
        _, saved, saved_trainer = read_checkpoint(ckpt / f"step_{from_step:08d}")
        # The reader names a tied weight under each of its names; the live state lists it once.
        assert saved_trainer["aliases"] == {"model/head.weight": "model/tok_emb.weight"}
        saved = {k: v for k, v in saved.items() if k not in saved_trainer["aliases"]}
        assert_same_tensors(saved, restored["tensors"], f"between the checkpoint of step {from_step} and the state "
                            f"restored from it at world size {world}")

    run_job(2, [*common, "--max-steps", str(steps_w2)], record_samples=True, ELASTIC_SAMPLE_LOG=str(log_prefix))
    resume(3, steps_w2, steps_w2 + steps_w3)
    resume(1, steps_w2 + steps_w3, total_steps)

    restores = [(e["step"], e["world_size"], e["saved_world_size"]) for e in events_of(events, "restore")]
    assert restores == [(steps_w2, 3, 2), (steps_w2 + steps_w3, 1, 3)]
    assert [e["step"] for e in events_of(events, "end")][-1] == total_steps
    samples = audit(log_prefix)
    assert samples.ok, samples.problems
    assert (samples.first_step, samples.last_step) == (1, total_steps)
    assert samples.epochs_complete == 1, "the W=1 run reaches the end of epoch 0"


# -- (c) a restore reads each byte once ---------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_restore_at_2_ranks_reads_each_byte_of_the_checkpoint_once(tmp_path: Path, tiny_corpus: Path, wrapper: str) -> None:
    ckpt, events = tmp_path / "ckpt", tmp_path / "events.jsonl"
    args = [
        "--data", str(tiny_corpus), "--ckpt-dir", str(ckpt), "--ckpt-every", "0", "--events", str(events),
        *QUIET, *TINY_MODEL, *(["--fsdp"] if wrapper == "fsdp" else []),
    ]
    run_job(2, [*args, "--max-steps", "4"])
    run_job(2, [*args, "--max-steps", "6"])

    (restore,) = events_of(events, "restore")
    assert (restore["step"], restore["world_size"], restore["saved_world_size"]) == (4, 2, 2)
    restored = ckpt / restore["checkpoint"]
    shards = sorted(p.name for p in restored.glob(SHARD_PREFIX + "*"))
    assert len(shards) == 2, f"one shard file per rank: {shards}"
    assert restore["bytes_read"] == shard_bytes(restored), (
        f"{wrapper}: the restore read {restore['bytes_read']} bytes of tensors, the checkpoint holds {shard_bytes(restored)}"
    )


# -- (d) wrappers the runtime cannot checkpoint ---------------------------------------------------------------

WRAPPED = textwrap.dedent("""
    import sys, warnings

    import torch
    import torch.distributed as dist

    import elastic
    from elastic._shared.common.cli import run_main

    warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")


    def main(argv=None):
        how, port, ckpt_dir = sys.argv[1:4]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        with elastic.Run(ckpt_dir=ckpt_dir) as run:  # adopts the group made above
            model = torch.nn.Linear(4, 4)
            if how == "fsdp1":
                from torch.distributed.fsdp import FullyShardedDataParallel

                model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
                optimizer = torch.optim.AdamW(model.parameters())
            else:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                model = run.ddp(model)
                optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
            run.start(model=model, optimizer=optimizer, data=16, batch_size=4)
            for _ in run.batches(max_steps=2):
                optimizer.step()
        return 0


    if __name__ == "__main__":
        sys.exit(run_main(main))
""")


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("fsdp1", "FSDP1 (FullyShardedDataParallel)"),
        ("zero", "ZeroRedundancyOptimizer shards its state without DTensors"),
    ],
)
def test_unsupported_wrapper_is_refused_in_one_line(tmp_path: Path, how: str, message: str) -> None:
    script = tmp_path / "wrapped.py"
    script.write_text(WRAPPED)
    ckpt = tmp_path / "ckpt"
    done = warm.run(
        [sys.executable, str(script), how, str(free_port()), str(ckpt)],
        timeout=120, cwd=tmp_path, env=worker_env(PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wrapped.py: error: ") and message in lines[0], done.stderr
    assert "use FSDP2" in lines[0]
    assert not ckpt.exists() or not any(ckpt.glob("step_*")), "nothing was saved"
