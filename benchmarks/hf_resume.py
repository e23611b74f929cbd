"""Resuming a Hugging Face Trainer job after a SIGKILL and after a resize: stock Trainer versus elastic.hf.Trainer.

    python benchmarks/hf_resume.py                   # about 6 minutes on 2 cores
    python benchmarks/hf_resume.py --json hf_resume.json

The same model, data and TrainingArguments (benchmarks/hf_resume_common.py:
the recipes' byte-level GPT-2, 2 layers, batch 8 per rank, save_steps 10,
40 steps), in two scripts that differ in one line, the import of `Trainer`:

- stock/torchrun: `transformers.Trainer`, resuming with `resume_from_checkpoint=
  get_last_checkpoint(output_dir)` (Hugging Face's documented way), under
  `torchrun --nnodes=1 --nproc-per-node=2` (c10d rendezvous on loopback);
- stock/torchrun-store-per-round: the same, with torch's
  `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (a worker store per rendezvous round:
  under the shared one, a restarted group can read a dead round's gloo
  addresses and hang in `init_process_group`, which accelerate calls as
  `TrainingArguments` is built);
- ours/torchrun: `elastic.hf.Trainer` under the same torchrun (checkpoints on
  disk only);
- ours/torchrevive-run: the same script under torchrevive-run (in-memory
  snapshots at their auto interval as well).

Each script logs the sample ids every rank trains on at every step. Per system:

1. an uninterrupted run: the reference weights;
2. one worker SIGKILLed at step `--kill-at` (the same for every system), the
   group restarted by the launcher (`--max-restarts=3`): steps redone (steps started before the kill
   and trained again after it), recovery time (kill -> the restarted group's
   first step starts), whether the final weights equal the reference's
   bit for bit;
3. a resize 2 -> 1: the job (2 workers) is SIGKILLed whole at step
   `--kill-at`, then launched again with 1 worker to the end. The audit
   follows the surviving history (the first launch's steps up to the one the
   second resumed from, then the second launch's) and counts, in each
   complete pass over the data set, the samples trained twice or never.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from elastic._agent.launcher.proctree import descendants, worker_rank
from elastic.chaos.netns import free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # its siblings, by plain name
from common import comma_list, kill_tree, read_jsonl  # noqa: E402
from provenance import write_result  # noqa: E402
SCRIPTS = {"stock": HERE / "hf_resume_stock.py", "ours": HERE / "hf_resume_elastic.py"}
SYSTEMS = {  # name: (script, launcher module, extra environment)
    "stock/torchrun": ("stock", "torch.distributed.run", {}),
    # torch's own switch for a worker store per round: the stock script without the shared store's stale addresses.
    "stock/torchrun-store-per-round": ("stock", "torch.distributed.run", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    "ours/torchrun": ("ours", "torch.distributed.run", {}),
    "ours/torchrevive-run": ("ours", "elastic._agent.launcher", {}),
}
LOG_ENV = "HF_RESUME_SAMPLE_LOG"
RESTARTS = 3
"""--max-restarts after a SIGKILL: room for a restart that fails on its own (stock torchrun's shared store)."""
WORDS = "the quick brown fox jumps over a lazy dog while every worker keeps its step".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=17, help="the step at which a worker (or the job) is killed")
    p.add_argument("--resume-timeout", type=float, default=150,
                   help="seconds a job may take to finish after the SIGKILL before it counts as hung (and is killed)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS))
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--workdir", type=Path, default=None)
    return p.parse_args(argv)


def corpus(directory: Path) -> Path:
    """About 240 windows of 33 bytes: 40 steps at 2 x 8 samples pass over them more than twice."""
    rng = random.Random(11)
    text = " ".join(rng.choice(WORDS) for _ in range(1_600))[:8_000]
    path = directory / "corpus.txt"
    path.write_text(text)
    return path


class Launch:
    """One launch of a script under a launcher, its sample log and its output folder."""

    def __init__(
        self, system: str, workdir: Path, data: Path, args: argparse.Namespace, nproc: int, restarts: int, name: str
    ) -> None:
        script, launcher, extra_env = SYSTEMS[system]
        self.log_prefix = workdir / f"samples-{name}"
        env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}}
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(HERE), **{LOG_ENV: str(self.log_prefix)}, **extra_env)
        command = [
            sys.executable, "-m", launcher, "--nnodes=1", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={workdir.name}",
            str(SCRIPTS[script]), "--data", str(data), "--output-dir", str(workdir / "out"),
            "--max-steps", str(args.steps), "--save-steps", str(args.save_steps),
        ]
        self.output = open(workdir / f"launch-{name}.log", "wb")
        self.process = subprocess.Popen(command, stdout=self.output, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self, timeout: float = 300) -> int | None:
        """The launcher's exit status; None if it ran past `timeout` (then the whole launch is killed)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            self.process.wait()
            return None
        finally:
            self.output.close()

    def kill_worker(self, rank: int) -> None:
        for pid in descendants(self.process.pid):
            if worker_rank(pid) == rank:
                os.kill(pid, signal.SIGKILL)
                return
        raise RuntimeError(f"no worker of rank {rank}")

    def kill_all(self) -> None:
        """SIGKILL the launcher and every worker (torchrun starts each worker in a session of its own)."""
        kill_tree(self.process.pid)


def records(prefix: Path) -> list[dict]:
    out = [record for path in sorted(prefix.parent.glob(prefix.name + ".rank*")) for record in read_jsonl(path)]
    return sorted(out, key=lambda r: r["time"])


def wait_for_step(prefix: Path, launch: Launch, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in records(prefix)):
        if launch.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job never reached step {step}; see {launch.output.name}")
        time.sleep(0.02)


def weights(workdir: Path) -> dict[str, torch.Tensor]:
    return load_file(workdir / "out" / "model.safetensors")


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def after_kill(prefix: Path) -> tuple[int, int, float] | None:
    """(the newest step the first group started, the first step a restarted group started, its start time);
    None when no restarted group started a step (the job never resumed)."""
    rows = records(prefix)
    before = max(r["step"] for r in rows if r["restart"] == 0)
    later = [r for r in rows if r["restart"] > 0]
    if not later:
        return None
    first = min(later, key=lambda r: r["time"])
    return before, first["step"], first["time"]


def exactly_once(first: Path, second: Path, num_samples: int) -> dict:
    """Samples trained twice or never in each complete pass over the data, along the surviving history:
    the first launch's steps up to the one the second launch resumed from, then the second launch's."""
    later = records(second)
    if not later:
        raise RuntimeError(f"the launch after the resize trained no step: the one before it ran to the end ({second})")
    resumed_from = min(r["step"] for r in later) - 1
    kept = [r for r in records(first) if r["step"] <= resumed_from]
    order = sorted(kept, key=lambda r: (r["step"], r["rank"])) + sorted(later, key=lambda r: (r["step"], r["rank"]))
    stream = [s for r in order for s in r["samples"]]
    passes = len(stream) // num_samples
    wrong = 0
    for p in range(passes):
        counts = torch.bincount(torch.tensor(stream[p * num_samples : (p + 1) * num_samples]), minlength=num_samples)
        wrong += int((counts != 1).sum())
    return {"passes": passes, "samples_wrong": wrong, "resumed_from": resumed_from}


def measure(system: str, root: Path, data: Path, args: argparse.Namespace, num_samples: int) -> dict:
    base = root / system.replace("/", "-")
    reference_dir, kill_dir, resize_dir = base / "reference", base / "kill", base / "resize"
    for d in (reference_dir, kill_dir, resize_dir):
        d.mkdir(parents=True)
    start = time.monotonic()
    launch = Launch(system, reference_dir, data, args, nproc=2, restarts=0, name="reference")
    if launch.wait() != 0:
        raise RuntimeError(f"{system}: the uninterrupted run failed; see {launch.output.name}")
    reference = weights(reference_dir)

    launch = Launch(system, kill_dir, data, args, nproc=2, restarts=RESTARTS, name="kill")
    wait_for_step(launch.log_prefix, launch, args.kill_at)
    killed_at = time.time()
    launch.kill_worker(1)
    code = launch.wait(args.resume_timeout)
    resumed = after_kill(launch.log_prefix)
    identical = code == 0 and same_weights(reference, weights(kill_dir))

    first = Launch(system, resize_dir, data, args, nproc=2, restarts=0, name="before-resize")
    wait_for_step(first.log_prefix, first, args.kill_at)
    first.kill_all()
    first.wait()
    second = Launch(system, resize_dir, data, args, nproc=1, restarts=0, name="after-resize")
    resize_code = second.wait()
    audit = exactly_once(first.log_prefix, second.log_prefix, num_samples) if resize_code == 0 else None
    return {
        "system": system, "exit_after_kill": code, "steps_redone": resumed[0] - resumed[1] + 1 if resumed else None,
        "recovery_s": resumed[2] - killed_at if resumed else None, "final_weights_identical": identical,
        "resize_exit": resize_code, "resize_audit": audit, "seconds": time.monotonic() - start,
    }


def report(results: list[dict], args: argparse.Namespace, num_samples: int) -> list[str]:
    """The lines printed from each system's figures (`measure`'s dicts): steps redone and recovery after
    the SIGKILL (or how the job never came back), whether it ended identical, the resize's audit."""
    lines = [f"\n{args.steps} steps, save_steps {args.save_steps}, 2 workers, a SIGKILL at step {args.kill_at}; "
             f"{num_samples} samples",
             f"{'script/launcher':31} {'redone':>7} {'recovery':>9} {'final = uninterrupted':>22} {'2->1: wrong samples':>20}"]
    for r in results:
        audit = r["resize_audit"]
        wrong = f"{audit['samples_wrong']} in {audit['passes']} pass(es)" if audit else f"exit {r['resize_exit']}"
        if r["recovery_s"] is None:
            how = "hung" if r["exit_after_kill"] is None else f"exit {r['exit_after_kill']}"
            redone, recovery = "-", f"never ({how})"
        else:
            redone, recovery = str(r["steps_redone"]), f"{r['recovery_s']:.1f}s"
        lines.append(f"{r['system']:31} {redone:>7} {recovery:>9} "
                     f"{'yes' if r['final_weights_identical'] else 'no':>22} {wrong:>20}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = comma_list(args.systems)
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown:
        print(f"hf_resume.py: error: unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    root = args.workdir or Path(tempfile.mkdtemp(prefix="hf-resume-"))
    root.mkdir(parents=True, exist_ok=True)
    data = corpus(root)
    sys.path.insert(0, str(HERE.parent / "recipes"))  # the windows the scripts train on (hf_resume_common)
    from text_data import split_corpus

    num_samples = len(split_corpus(data.read_bytes(), block_size=32, val_fraction=0.01)[0])
    results = [measure(system, root, data, args, num_samples) for system in chosen]
    print("\n".join(report(results, args, num_samples)))
    if args.json:
        write_result(args.json, "hf_resume", {"steps": args.steps, "kill_at": args.kill_at, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
