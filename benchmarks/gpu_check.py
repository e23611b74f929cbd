"""Every CUDA path of the runtime on one GPU, in one command, with the figures a GPU user asks for.

    python benchmarks/gpu_check.py                  # on a CUDA machine: at most 8 minutes
    python benchmarks/gpu_check.py --dry-run        # on CPU: every part that can run there, tiny and quick

Each part runs what a GPU user runs: the GPT recipe (recipes/gpt.py) under `torchrevive-run`
(`python -m elastic._agent.launcher`, its entry point) with the recipe's public flags, `--device
cuda`, bf16 autocast (the recipe's own on CUDA) and NCCL (the runtime's backend for a GPU). Each
part has its own time limit; a part that fails is recorded with a one-line reason and the others
still run. The parts:

- ddp-gpu, ddp-2, fsdp-gpu, fsdp-2: a ~128M-parameter GPT (GPT-2 small's width, 18 layers, bytes as
  tokens, 1024-token context) with `--nproc-per-node=gpu` (a worker per GPU) and with 2 workers
  (on one GPU both share it, if NCCL lets them), DDP and `--fsdp`: steps/s over the steps after
  the warm-up ones, and model FLOPs utilisation as nanoGPT computes it (`estimate_mfu`: 6N + 12LHQT
  FLOPs per token, here `GPT.flops_per_token`) against the GPU's peak dense bf16 FLOPs, looked up
  by the device's name (no MFU for a GPU not in the table). No checkpoints: the model's speed.
- small-model: the recipe's default model, `--nproc-per-node=gpu`: what the quick start trains.
- snapshot-copy: the in-memory snapshot's device-to-host copy (elastic._worker.checkpoint.snapshot's
  `DeferredCopy`, on its own copy stream) into pinned host memory, into pageable memory, and into
  the memory tier's own slot in /dev/shm (where a snapshot's parameters and optimizer state go), GB/s.
- snapshot-stall: ddp-gpu again with `--ckpt-dir` and `--snapshot-every 1` (a snapshot every step):
  the loop's stall per snapshot, from the two step rates.
- kill: a job of the small model with snapshots every step; its rank 0 worker is SIGKILLed at a
  step (held there by ELASTIC_FAULT's hold until the kill): seconds from the kill to the first step
  of the restarted group, and where the restore came from (the job's event log), `--deterministic`.
- exactness: the same job uninterrupted; its final checkpoint compared tensor by tensor, bit for
  bit, with the killed job's.
- hang: a worker's main thread hangs (ELASTIC_FAULT do=hang) in a job of 2 workers where two fit
  (else 1): the hang watchdog (`--hang-timeout`) ends the group, NCCL's communicators are aborted
  (the runtime's error teardown) and the job restarts and ends; seconds from the last step before
  the hang to the first after it, and the log's lines that say so.

Everything goes to one JSON file (`--json`), and a one-screen summary is printed; the exit status
is 1 when a part failed. `--dry-run` runs the parts that CPU allows (gloo, a tiny model, a few
steps) and records the others as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic import OneLineArgumentParser, non_negative_float, positive_int

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "gpt.py"
sys.path.insert(0, str(REPO / "recipes"))  # the recipe's model, for its parameter and FLOP counts
sys.path.insert(0, str(REPO / "benchmarks"))  # its siblings, by plain name
from common import comma_list, kill_tree, memory_dir, read_jsonl  # noqa: E402

PEAK_BF16_TFLOPS = (("H100 PCIE", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
"""Dense bf16 tensor-core peaks (no sparsity), by a piece of the device name, the first match winning:
H100 SXM and H200 989 TFLOPS, H100 PCIe 756, A100 (SXM and PCIe) 312."""

LARGE_MODEL = {"n_layer": 18, "n_head": 12, "n_embd": 768, "block_size": 1024, "batch_size": 16}
"""About 128M parameters: GPT-2 small's width and context with byte tokens (its 50k-token embedding
is what makes GPT-2 small 124M at 12 layers; here the layers carry the parameters)."""
SMALL_MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128, "batch_size": 16}
"""The recipe's defaults."""
TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "batch_size": 8}
"""--dry-run's model: a step in milliseconds on one core."""

FIGURES = (
    ("world_size", "world {}", "{:d}"),
    ("steps_per_s", "{} steps/s", "{:.2f}"),
    ("mfu", "MFU {}", "{:.1%}"),
    ("parameters_m", "{}M params", "{:.3g}"),
    ("pinned_gb_s", "pinned {} GB/s", "{:.1f}"),
    ("pageable_gb_s", "pageable {} GB/s", "{:.1f}"),
    ("snapshot_slot_gb_s", "snapshot slot {} GB/s", "{:.1f}"),
    ("stall_per_snapshot_s", "stall {} s/snapshot", "{:.3f}"),
    ("kill_to_step_s", "kill to step {} s", "{:.2f}"),
    ("restore_source", "restored from {}", "{}"),
    ("hang_to_step_s", "hang to step {} s", "{:.1f}"),
    ("abort_lines", "{} abort line(s)", "{:d}"),
    ("identical", "bit-identical: {}", "{}"),
    ("tensors", "{} tensors", "{:d}"),
)
"""What the summary shows of a part's figures, in this order: (key, words, format of the value)."""


# -- pure figures ------------------------------------------------------------------------------------


def peak_bf16_tflops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak in TFLOPS, or None for one not in the table (no MFU then). NVL
    parts (other clocks and power) are not in it."""
    name = device_name.upper()
    if "NVL" in name:
        return None
    return next((peak for piece, peak in PEAK_BF16_TFLOPS if piece in name), None)


def model_flops_utilisation(flops_per_token: float, tokens_per_step: int, steps_per_s: float,
                            peak_tflops: float, gpus: int) -> float:
    """nanoGPT's estimate_mfu: the model's FLOPs per second (forward and backward) over the peak of
    the GPUs the job used."""
    return flops_per_token * tokens_per_step * steps_per_s / (peak_tflops * 1e12 * gpus)


def steps_per_second(records: Sequence[dict[str, Any]], warmup: int) -> float | None:
    """The step rate of a job's first group after its first `warmup` steps (compilation, allocator
    and NCCL warm-up), from the event log's step times; None with fewer than two steps to time."""
    steps: dict[int, float] = {}
    for record in records:
        if record.get("event") == "start" and steps:
            break  # a restarted group: its steps are not the first group's rate
        if record.get("event") == "step" and record["step"] > warmup:
            steps.setdefault(record["step"], record["time"])
    if len(steps) < 2:
        return None
    first, last = min(steps), max(steps)
    seconds = steps[last] - steps[first]
    return (last - first) / seconds if seconds > 0 else None


def first_step_after(records: Sequence[dict[str, Any]], moment: float) -> dict[str, Any] | None:
    """The first step finished by a group that started after `moment` (its "start" event), as the
    chaos harness times a recovery."""
    started = None
    for record in records:
        if record["time"] <= moment:
            continue
        if record["event"] == "start":
            started = record["step"]
        elif record["event"] == "step" and started is not None and record["step"] > started:
            return record
    return None


def restore_after(records: Sequence[dict[str, Any]], moment: float) -> dict[str, Any] | None:
    return next((r for r in records if r["event"] == "restore" and r["time"] > moment), None)


_TORCH_LOG_PREFIX = re.compile(r"^[IWE]\d{4} [\d:.]+ \d+ \S+\] ")
"""torch's log lines: "E1127 13:57:02.675000 29489 path/api.py:836] message"."""


def failure_reason(log: str) -> str:
    """One line saying why a job failed: the last error its processes printed (not the launcher's
    ChildFailedError wrapper), else the log's last line; without torch's log prefix."""
    lines = [_TORCH_LOG_PREFIX.sub("", line).strip() for line in log.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if re.search(r"\b\w*(Error|Exception)\b|\berror:", line)
              and "ChildFailedError" not in line and not line.startswith("File ")]
    reason = (errors or lines or ["no output"])[-1]
    return reason if len(reason) <= 240 else reason[:237] + "..."


def abort_lines(log: str) -> list[str]:
    """The log's lines about communicators aborted or a hung group ended, those saying what ended it first:
    the watchdog's line, or the agent's ending the culprit that hang naming found (on a loaded machine the
    log can hold more abort lines before them than a summary keeps). The culprit's own stack dump is not
    evidence: its frames name watchdog.py whether or not the watchdog ended anything."""
    pattern = re.compile(r"abort|watchdog|exitcode\s*:\s*124|no step completed|the hang's culprit", re.IGNORECASE)
    lines = [line.strip() for line in log.splitlines() if pattern.search(line) and not _STACK_FRAME.match(line)]
    return sorted(lines, key=lambda line: not ended_the_group(line))


_STACK_FRAME = re.compile(r'\s*File "[^"]*", line \d+')


def ended_the_group(line: str) -> bool:
    """Whether an abort line says what ended the hung group: the watchdog, or the agent ending the culprit."""
    return line.lower().startswith("watchdog:") or "the hang's culprit, so that" in line


def snapshots_off(log: str) -> str | None:
    """The runtime's line saying in-memory snapshots are off (a full /dev/shm, no keeper), if any."""
    return next((_TORCH_LOG_PREFIX.sub("", line).strip() for line in log.splitlines()
                 if "in-memory snapshots are off" in line), None)


def compare_states(left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    """Two checkpoints' tensors (by key) compared bit for bit: the same keys, dtypes, shapes and bytes."""
    import torch

    def bits(t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().cpu().contiguous().reshape(-1)
        return flat.view(torch.uint8) if flat.numel() else flat  # the bytes: -0.0 and NaN payloads count

    differing = sorted(set(left) ^ set(right))
    for key in sorted(set(left) & set(right)):
        a, b = left[key], right[key]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            differing.append(key)
    return {"identical": not differing, "tensors": len(set(left) | set(right)), "differing": differing[:5]}


def summary_lines(results: dict[str, Any]) -> list[str]:
    """The one-screen summary: the device, then a line per part (its status, figures or reason)."""
    device = results.get("device", {})
    peak = device.get("peak_bf16_tflops")
    lines = [f"gpu check on {device.get('name', 'an unknown device')} ({'dry run, CPU' if results.get('dry_run') else 'CUDA'}); "
             + (f"peak bf16 {peak:g} TFLOPS" if peak else f"peak bf16 unknown: {device.get('peak_note', 'no MFU')}")]
    for name, part in results["parts"].items():
        status = part["status"]
        if status == "ok":
            shown = [words.format(fmt.format(part[key])) for key, words, fmt in FIGURES if part.get(key) is not None]
            detail = ", ".join(shown) or "done"
        else:
            detail = part.get("reason", "")
        lines.append(f"  {name:15} {status:8} {detail}")
    failed = [n for n, p in results["parts"].items() if p["status"] == "failed"]
    lines.append(f"{len(failed)} part(s) failed" + (f": {', '.join(failed)}" if failed else "")
                 + f"; every figure: {results.get('json', 'the JSON file')}")
    return lines


# -- jobs --------------------------------------------------------------------------------------------


@dataclass
class JobResult:
    returncode: int | None
    records: list[dict[str, Any]]
    log: str


@dataclass
class Check:
    """What every part shares: where its files go, the device, the budget left."""

    workdir: Path
    dry_run: bool
    cuda: bool
    gpus: int
    corpus: Path
    deadline: float
    two_ranks_fail: str | None = None
    """Why a job of 2 workers could not run here (set by ddp-2): later 2-worker parts skip."""
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def per_gpu(self) -> str:
        """A worker per GPU (`--nproc-per-node=gpu`); on CPU one worker."""
        return "gpu" if self.cuda else "1"

    def recipe_args(self, model: dict[str, int], steps: int, *extra: str) -> list[str]:
        shape = [f"--{k.replace('_', '-')}={v}" for k, v in model.items()]
        return ["--data", str(self.corpus), "--device", "cuda" if self.cuda else "cpu", "--max-steps", str(steps),
                "--eval-every", "0", "--sample-tokens", "0", "--log-every", "1000", *shape, *extra]


def launcher_command(nproc: str, max_restarts: int, script_args: Sequence[str]) -> list[str]:
    """torchrevive-run (its module) on this one machine, the GPT recipe with `script_args`."""
    return [sys.executable, "-m", "elastic._agent.launcher", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", str(RECIPE), *script_args]


class Job:
    """One launcher process and what it wrote: its log, its event log."""

    def __init__(self, directory: Path, nproc: str, script_args: Sequence[str], *, max_restarts: int = 0,
                 env: dict[str, str] | None = None) -> None:
        # Run again in the same --workdir, a job would append to the old event log, resume from the old
        # checkpoint and find the old fault's marks: each job starts in an empty folder.
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.events = directory / "events.jsonl"
        self.log_path = directory / "launcher.log"
        environ = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                    "MASTER_PORT", "ELASTIC_FAULT"}}
        environ.update(PYTHONUNBUFFERED="1", **(env or {}))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                launcher_command(nproc, max_restarts, [*script_args, "--events", str(self.events)]),
                stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=REPO,
            )

    def records(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pid(self, rank: int) -> int | None:
        from elastic._agent.launcher.proctree import descendants, worker_rank

        return next((pid for pid in descendants(self.process.pid) if worker_rank(pid) == rank), None)

    def wait(self, deadline: float) -> JobResult:
        try:
            self.process.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise PartFailed(f"the job did not end within its time limit; last: {failure_reason(self.log())}") from None
        return JobResult(self.process.returncode, self.records(), self.log())

    def stop(self) -> None:
        """The launcher and every process below it (workers run in sessions of their own)."""
        kill_tree(self.process.pid)
        self.process.wait()


class PartFailed(Exception):
    """A part's one-line reason for failing."""


def wait_until(condition: Callable[[], Any], deadline: float, what: str, job: Job) -> Any:
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if job.process.poll() is not None:
            raise PartFailed(f"the job ended (exit {job.process.returncode}) before {what}: {failure_reason(job.log())}")
        time.sleep(0.05)
    raise PartFailed(f"no {what} within the part's time limit")


def run_job(check: Check, name: str, nproc: str, args: Sequence[str], deadline: float, **kwargs: Any) -> JobResult:
    job = Job(check.workdir / name, nproc, args, **kwargs)
    result = job.wait(deadline)
    if result.returncode != 0:
        raise PartFailed(f"exit {result.returncode}: {failure_reason(result.log)}")
    return result


# -- parts --------------------------------------------------------------------------------------------


def flops_per_token(model: dict[str, int]) -> tuple[int, int]:
    """(parameters, training FLOPs per token) of the recipe's GPT of this shape, built on no device."""
    import torch
    from gpt_model import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(**{k: v for k, v in model.items() if k != "batch_size"}))
    return gpt.num_parameters(), gpt.flops_per_token()


def throughput(check: Check, name: str, nproc: str, model: dict[str, int], deadline: float, *extra: str,
               steps: int = 150, warmup: int = 30) -> dict[str, Any]:
    """Steps/s of the recipe after `warmup` steps, and its MFU where the GPU's peak is known."""
    if check.dry_run:
        steps, warmup = 8, 2
    # A group that cannot form (NCCL refusing two ranks on one GPU, say) errors within a minute.
    args = check.recipe_args(model, steps, "--collective-timeout", "60", *extra)
    result = run_job(check, name, nproc, args, deadline)
    rate = steps_per_second(result.records, warmup)
    start = next((r for r in result.records if r["event"] == "start"), None)
    if rate is None or start is None:
        raise PartFailed(f"the event log holds too few steps to time ({len(result.records)} records)")
    parameters, per_token = flops_per_token(model)
    world = int(start["world_size"])
    figures: dict[str, Any] = {"world_size": world, "steps_per_s": rate, "parameters_m": parameters / 1e6,
                               "tokens_per_step": start["tokens_per_step"], "flops_per_token": per_token,
                               "steps_timed": steps - warmup, "mfu": None}
    peak = check.results["device"].get("peak_bf16_tflops")
    if peak:
        gpus = min(world, check.gpus)
        figures["mfu"] = model_flops_utilisation(per_token, start["tokens_per_step"], rate, peak, gpus)
        figures["gpus"] = gpus
    return figures


def part_two_workers(check: Check, name: str, model: dict[str, int], deadline: float, *extra: str) -> dict[str, Any]:
    if check.two_ranks_fail is not None:
        raise PartSkipped(f"2 workers cannot run here ({check.two_ranks_fail})")
    try:
        return throughput(check, name, "2", model, deadline, *extra)
    except PartFailed as exc:
        check.two_ranks_fail = f"{name}: {exc}"
        raise


class PartSkipped(Exception):
    """A part that cannot run here, and why."""


def part_snapshot_copy(check: Check, deadline: float) -> dict[str, Any]:
    """The copy, measured in a process of its own (a CUDA error there cannot take the check down)."""
    out = check.workdir / "snapshot-copy.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--measure-copy", str(out)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(1.0, deadline - time.time()), cwd=REPO,
                              check=False)
    except subprocess.TimeoutExpired:
        raise PartFailed("the copy did not finish within the part's time limit") from None
    if done.returncode != 0:
        raise PartFailed(f"exit {done.returncode}: {failure_reason(done.stdout + done.stderr)}")
    return json.loads(out.read_text())


def measure_copy(device_name: str = "cuda", megabytes: int = 1024, repeats: int = 5) -> dict[str, Any]:
    """GB/s of the snapshot's device-to-host copy of `megabytes` of parameters (16 tensors), the median
    of `repeats` copies after one that allocates: into pinned buffers, pageable ones and the memory
    tier's shared-memory slot. Pinned needs CUDA (None on CPU)."""
    import torch

    from elastic._worker.checkpoint.snapshot import BufferPool, DeferredCopy
    from elastic._worker.checkpoint.snapshot_slots import Layout, Slot
    from elastic._shared.storage.chunks import BLOCK

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device) if cuda else None
    each = megabytes * 2**20 // 4 // 16
    tensors = {f"p{i}": torch.randn(each, device=device) for i in range(16)}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def gb_per_s(pool: Any) -> float:
        """`pool`: a BufferPool (a save's host buffers), or the memory tier's Slot (its views, made once)."""
        seconds = []
        for _ in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            if isinstance(pool, Slot):
                DeferredCopy(device, stream).run_pairs(lambda: [(t, pool.views[key]) for key, t in tensors.items()])
            else:
                DeferredCopy(device, stream).run(lambda: tensors, pool)
            if cuda:
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
        return nbytes / statistics.median(seconds[1:]) / 1e9

    figures: dict[str, Any] = {
        "megabytes": nbytes / 1e6,
        "pinned_gb_s": gb_per_s(BufferPool(pin_memory=True)) if cuda else None,
        "pageable_gb_s": gb_per_s(BufferPool(pin_memory=False)),
        "snapshot_slot_gb_s": None,
    }
    slot_dir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=memory_dir()))
    try:
        slot = Slot(slot_dir / "slot.data", 0, Layout.of(tensors), BLOCK)
        figures["snapshot_slot_gb_s"] = gb_per_s(slot)
        del slot
    except OSError as exc:  # a /dev/shm smaller than the state: what the memory tier would meet too
        figures["snapshot_slot_error"] = f"{slot_dir}: {exc.strerror or exc}"
    finally:
        shutil.rmtree(slot_dir, ignore_errors=True)
    return figures


def part_snapshot_stall(check: Check, deadline: float) -> dict[str, Any]:
    plain = check.results["parts"].get("ddp-gpu", {})
    if plain.get("status") != "ok":
        raise PartSkipped("needs ddp-gpu's step rate, which is missing")
    ckpt = check.workdir / "snapshot-stall" / "ckpt"
    try:
        # Fewer steps: each waits for the previous step's snapshot (~1.5 GB copied, checksummed).
        figures = throughput(check, "snapshot-stall", check.per_gpu, LARGE_MODEL, deadline,
                             "--ckpt-dir", str(ckpt), "--ckpt-every", "0", "--snapshot-every", "1", steps=60, warmup=10)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)  # a large model's final checkpoint: nothing reads it
    off = snapshots_off((check.workdir / "snapshot-stall" / "launcher.log").read_text(errors="replace"))
    if off is not None:
        raise PartFailed(off)
    figures["stall_per_snapshot_s"] = 1 / figures["steps_per_s"] - 1 / plain["steps_per_s"]
    figures["mfu"] = None  # the model's MFU is ddp-gpu's
    return figures


def fault_job_args(check: Check, name: str, steps: int, *extra: str) -> list[str]:
    """The kill and exactness jobs' recipe arguments: the small model (tiny in a dry run),
    deterministic, a snapshot every step, the final checkpoint in the part's folder."""
    model = TINY_MODEL if check.dry_run else SMALL_MODEL
    return check.recipe_args(model, steps, "--deterministic", "--ckpt-dir", str(check.workdir / name / "ckpt"),
                             "--ckpt-every", "0", "--snapshot-every", "1", *extra)


def fault_steps(check: Check) -> tuple[int, int]:
    """(the step a fault strikes at, the job's last step)."""
    return (4, 8) if check.dry_run else (40, 120)


def after_fault(result: JobResult, fault: str, at: float) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The first step after the `fault` at time `at`, and the restore after it (None: the job started over);
    the job must have ended well and trained after the fault."""
    if result.returncode != 0:
        raise PartFailed(f"exit {result.returncode} after the {fault}: {failure_reason(result.log)}")
    step = first_step_after(result.records, at)
    if step is None:
        raise PartFailed(f"no step after the {fault} in the event log")
    return step, restore_after(result.records, at)


def part_kill(check: Check, deadline: float) -> dict[str, Any]:
    at, steps = fault_steps(check)
    hold = check.workdir / "kill" / "hold"
    job = Job(check.workdir / "kill", check.per_gpu, fault_job_args(check, "kill", steps), max_restarts=3,
              env={"ELASTIC_FAULT": f"after_step@{at}:do=hold:until={hold}"})
    try:
        wait_until(Path(f"{hold}.held").exists, deadline, f"step {at}", job)
        pid = wait_until(lambda: job.worker_pid(0), deadline, "rank 0's worker", job)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        hold.touch()  # (the restarted worker does not hold: the fault fires on the first attempt only)
        result = job.wait(deadline)
    except BaseException:
        if job.process.poll() is None:
            job.stop()
        raise
    step, restore = after_fault(result, "kill", killed_at)
    return {"killed_at_step": at, "kill_to_step_s": step["time"] - killed_at,
            "restore_source": restore.get("source") if restore else "none (started over)",
            "restored_step": restore["step"] if restore else 0, "redone": restore.get("redone") if restore else None,
            "final_step": max(r["step"] for r in result.records if r["event"] == "step")}


def newest_checkpoint(folder: Path) -> Path:
    found = sorted(folder.glob("step_*"))
    if not found:
        raise PartFailed(f"no checkpoint in {folder}")
    return found[-1]


def part_exactness(check: Check, deadline: float) -> dict[str, Any]:
    if check.results["parts"].get("kill", {}).get("status") != "ok":
        raise PartSkipped("needs the killed run of the kill part, which did not end well")
    from elastic import read_checkpoint

    _, steps = fault_steps(check)
    run_job(check, "exactness", check.per_gpu, fault_job_args(check, "exactness", steps), deadline)
    killed, uninterrupted = newest_checkpoint(check.workdir / "kill" / "ckpt"), newest_checkpoint(check.workdir / "exactness" / "ckpt")
    if killed.name != uninterrupted.name:
        raise PartFailed(f"the runs ended at different steps: {killed.name} and {uninterrupted.name}")
    figures = compare_states(read_checkpoint(killed)[1], read_checkpoint(uninterrupted)[1])
    figures["checkpoint"] = killed.name
    warned = [line for line in (check.workdir / "exactness" / "launcher.log").read_text(errors="replace").splitlines()
              if "does not have a deterministic implementation" in line]
    figures["nondeterministic_ops"] = warned[:3]
    return figures


def held_then(hold: Path, rank: int, at: int, then: str) -> str:
    """ELASTIC_FAULT for `rank` after step `at`: hold (which marks its start in `hold`.held) until
    `hold` exists, then the fault `then`: the part knows when the fault began, to the 50 ms the hold
    polls at (a hung or killed worker's last step events may never reach the event log)."""
    return f"after_step@{at}:rank={rank}:do=hold:until={hold},after_step@{at}:rank={rank}{then}"


def wait_for_hold(job: Job, hold: Path, at: int, deadline: float) -> float:
    """When the hold began (its mark's time); lets it go."""
    held = Path(f"{hold}.held")
    wait_until(held.exists, deadline, f"step {at}", job)
    hold.touch()
    return held.stat().st_mtime


def part_hang(check: Check, deadline: float) -> dict[str, Any]:
    """2 workers where they fit (else 1, and then no peer waits on the hung one); the last rank hangs."""
    at, steps = fault_steps(check)
    world = 1 if check.two_ranks_fail else 2
    timeout = 2.0 if check.dry_run else 10.0
    hold = check.workdir / "hang" / "hold"
    args = fault_job_args(check, "hang", steps, "--hang-timeout", f"{timeout:g}", "--collective-timeout", "30")
    job = Job(check.workdir / "hang", str(world), args, max_restarts=3,
              env={"ELASTIC_FAULT": held_then(hold, world - 1, at, ":do=hang")})
    try:
        hung_at = wait_for_hold(job, hold, at, deadline)
        result = job.wait(deadline)
    except BaseException:
        if job.process.poll() is None:
            job.stop()
        raise
    step, restore = after_fault(result, "hang", hung_at)
    lines = abort_lines(result.log)
    return {"world_size": world, "hung_rank": world - 1, "hang_timeout_s": timeout,
            "hang_to_step_s": step["time"] - hung_at, "restore_source": restore.get("source") if restore else None,
            "abort_lines": len(lines), "abort_evidence": lines[:8],
            "peer_note": None if world == 2 else f"one worker: no peer to abort ({check.two_ranks_fail})"}


@dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Check, float], dict[str, Any]]
    timeout: float
    needs_cuda: bool = False
    in_dry_run: bool = True


def parts() -> list[Part]:
    """In the order they run: the model's speed first, then the copy, then the faults."""
    return [
        Part("ddp-gpu", lambda c, d: throughput(c, "ddp-gpu", c.per_gpu, LARGE_MODEL, d), 150, needs_cuda=True),
        Part("ddp-2", lambda c, d: part_two_workers(c, "ddp-2", TINY_MODEL if c.dry_run else LARGE_MODEL, d), 120),
        Part("fsdp-gpu", lambda c, d: throughput(c, "fsdp-gpu", c.per_gpu, LARGE_MODEL, d, "--fsdp"), 150, needs_cuda=True),
        Part("fsdp-2", lambda c, d: part_two_workers(c, "fsdp-2", LARGE_MODEL, d, "--fsdp"), 120, in_dry_run=False),
        Part("snapshot-copy", part_snapshot_copy, 120, needs_cuda=True),
        Part("snapshot-stall", part_snapshot_stall, 150, needs_cuda=True),
        Part("kill", part_kill, 150),
        Part("exactness", part_exactness, 120),
        Part("hang", part_hang, 150),
        Part("small-model", lambda c, d: throughput(c, "small-model", c.per_gpu, SMALL_MODEL, d), 90, needs_cuda=True),
    ]


def run_part(check: Check, part: Part) -> dict[str, Any]:
    if part.needs_cuda and not check.cuda:
        return {"status": "skipped", "reason": "needs CUDA" + (" (dry run on CPU)" if check.dry_run else "")}
    if check.dry_run and not part.in_dry_run:
        return {"status": "skipped", "reason": "dry run: the same path as a part that ran (ddp-2, with --fsdp)"}
    left = check.deadline - time.time()
    if left < 20:
        return {"status": "skipped", "reason": "the check's time budget ran out (--budget)"}
    started = time.time()
    print(f"{part.name}: running (at most {min(part.timeout, left):.0f} s)", flush=True)
    try:
        figures = part.run(check, started + min(part.timeout, left))
        outcome = {"status": "ok", **figures}
    except PartSkipped as exc:
        outcome = {"status": "skipped", "reason": str(exc)}
    except PartFailed as exc:
        outcome = {"status": "failed", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one part's bug is its line in the summary, not the check's end
        outcome = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}".splitlines()[0][:240]}
    outcome["seconds"] = time.time() - started
    return outcome


def describe_device() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"name": "CPU", "count": 0, "torch": torch.__version__, "peak_bf16_tflops": None,
                "peak_note": "no GPU: no MFU"}
    name = torch.cuda.get_device_name(0)
    peak = peak_bf16_tflops(name)
    try:
        import torch.cuda.nccl

        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001 - a figure for the record only
        nccl = f"unknown ({type(exc).__name__})"
    return {"name": name, "count": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": nccl, "peak_bf16_tflops": peak,
            "peak_note": None if peak else f"{name!r} is not in the peak table: no MFU"}


def write_corpus(directory: Path) -> Path:
    """The text the jobs learn: this repository's Python sources (about 1 MB)."""
    path = directory / "corpus.txt"
    path.write_text("".join(p.read_text() for p in sorted(REPO.glob("elastic/**/*.py"))))
    return path


RUNTIME_MODULES = ("crc32c", "cryptography", "prometheus_client", "tqdm", "numpy")
"""What the launcher and the workers import beyond torch (pyproject.toml's dependencies they use)."""


def not_ready() -> str | None:
    """Why the jobs cannot run here, in one line, before any starts: the package must be installed
    (`pip install -e .`: its entry points carry ELASTIC_FAULT's injector) with its dependencies."""
    missing = [name for name in RUNTIME_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        return f"missing Python packages: {', '.join(missing)} (pip install -e . installs them)"
    faults = {entry.name for entry in importlib.metadata.entry_points(group="torchrevive.faults")}
    if "chaos" not in faults:
        return "torchrevive is not installed (its fault injector's entry point is missing): pip install -e ."
    return None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on CPU: the parts CPU allows, tiny and quick")
    p.add_argument("--json", default="runs/gpu-check.json", help="where every figure goes")
    p.add_argument("--workdir", default="runs/gpu-check", help="the jobs' logs, event logs and checkpoints")
    p.add_argument("--budget", type=non_negative_float, default=480.0, help="seconds for the whole check")
    p.add_argument("--only", default=None, help="run only these parts (comma-separated), e.g. to run a failed one again")
    p.add_argument("--copy-mb", type=positive_int, default=1024, help="megabytes the snapshot-copy part copies")
    p.add_argument("--measure-copy", metavar="OUT", default=None,
                   help="(the snapshot-copy part's own process) measure the copy here on CUDA, write OUT and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.measure_copy is not None:
        Path(args.measure_copy).write_text(json.dumps(measure_copy("cuda", args.copy_mb)))
        return 0
    known = [part.name for part in parts()]
    chosen = known if args.only is None else comma_list(args.only)
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        print(f"gpu_check.py: error: --only takes parts among {', '.join(known)}; not {', '.join(unknown) or 'nothing'}",
              file=sys.stderr)
        return 2
    why = not_ready()
    if why is not None:
        print(f"gpu_check.py: error: {why}", file=sys.stderr)
        return 2
    device = describe_device()
    if device["count"] == 0 and not args.dry_run:
        print("gpu_check.py: error: no CUDA device is visible; run with --dry-run to check the paths on CPU",
              file=sys.stderr)
        return 2
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    check = Check(workdir=workdir, dry_run=args.dry_run, cuda=device["count"] > 0 and not args.dry_run,
                  gpus=device["count"], corpus=write_corpus(workdir), deadline=time.time() + args.budget)
    check.results = {"dry_run": args.dry_run, "device": device, "json": str(Path(args.json).resolve()), "parts": {}}
    for part in parts():
        if part.name in chosen:
            check.results["parts"][part.name] = run_part(check, part)
            json_path = Path(args.json)
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(check.results, indent=1, default=str))  # written as it goes
    print("\n".join(summary_lines(check.results)))
    return 1 if any(p["status"] == "failed" for p in check.results["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
