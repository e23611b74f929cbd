"""One rank of benchmarks/checkpoint.py's distributed comparison; torchrun runs it, not a person.

The `elastic` measured is whichever comes first on PYTHONPATH: the benchmark
points it at this checkout (the sharded DCP path) or at commit 6ec689c's tree,
extracted (today's rank-0 torch.save path). The GPT comes from that tree's
recipes/, and this file imports nothing else of the checkout, so the old code
runs as it was.

    --phase save:    train (DDP or FSDP2), time a synchronous torch.save, then
                     `--saves` async saves through the CheckpointManager, and a
                     final untimed save whose state is fingerprinted.
    --phase restore: a fresh job (as after a restart) builds the same model and
                     optimizer and times `CheckpointManager.restore()`, counting
                     the bytes it reads from the checkpoint directory, and checks
                     the restored state against the saved fingerprint.

Each rank writes `<phase>_rank<r>.json` into `--out`.
"""

from __future__ import annotations

import argparse
import builtins
import importlib
import io
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import elastic

TREE = Path(elastic.__file__).resolve().parent.parent
sys.path.insert(0, str(TREE / "recipes"))

from gpt_model import BYTE_VOCAB, GPT, GPTConfig, configure_optimizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name (this checkout's)
from common import HookWait  # noqa: E402 - standard library only: it imports nothing of the tree compared

# The trees compared lay the package out differently (flat modules before the role packages of
# elastic/_worker) and take the manager's settings differently (a RunConfig since elastic/config.py,
# 6ec689c's as keywords). Decided by the tree, never by trying an import (an editable install could
# hand this checkout's module to an old tree).
PACKAGES = (TREE / "elastic" / "_worker").is_dir()
SETTINGS_AS_CONFIG = (TREE / "elastic" / ("_worker/config.py" if PACKAGES else "config.py")).is_file()


def _from(packaged: str, flat: str) -> Any:
    return importlib.import_module(packaged if PACKAGES else flat)


CheckpointManager = _from("elastic._worker.checkpoint", "elastic.checkpoint").CheckpointManager
ElasticSampler = _from("elastic._worker.data.sampler", "elastic.sampler").ElasticSampler
WarmupCosine = _from("elastic._worker.run.schedules", "elastic.schedules").WarmupCosine
_runtime = _from("elastic._worker.runtime.context", "elastic.runtime")
WorkerContext, init_worker, shutdown_worker = _runtime.WorkerContext, _runtime.init_worker, _runtime.shutdown_worker
_rng = _from("elastic._worker.runtime.rng", "elastic.rng")
get_rng_state, seed_all = _rng.get_rng_state, _rng.seed_all


def checkpoint_name(step: int) -> str:
    """A committed checkpoint's directory name, the same in both trees."""
    return f"step_{step:08d}"

# The recipe's optimiser settings (recipes/gpt.py defaults), as in checkpoint.py.
LR, WEIGHT_DECAY, MIN_LR_RATIO, GRAD_CLIP = 1e-3, 0.1, 0.1, 1.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="checkpoint_worker.py")
    p.add_argument("--phase", choices=("save", "restore"), required=True)
    p.add_argument("--mode", choices=("ddp", "fsdp"), required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--n-head", type=int, required=True)
    p.add_argument("--n-embd", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--context", type=int, required=True, help="tokens per training sequence (<= block size)")
    p.add_argument("--batch-size", type=int, required=True, help="sequences per rank per step")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p


def peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux: ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- bytes read from the checkpoint directory ---------------------------------------------


class _CountingFile:
    """A file object that adds what is read through it to `counts[name]` (bytes; text as UTF-8)."""

    def __init__(self, f: Any, counts: dict[str, int], name: str) -> None:
        self._f = f
        self._counts = counts
        self._name = name

    def _add(self, data: Any) -> Any:
        if isinstance(data, str):
            self._count(len(data.encode("utf-8")))
        elif data is not None:
            self._count(len(data))
        return data

    def _count(self, n: int | None) -> None:
        self._counts[self._name] = self._counts.get(self._name, 0) + (n or 0)

    def read(self, *args: Any) -> Any:
        return self._add(self._f.read(*args))

    def read1(self, *args: Any) -> Any:
        return self._add(self._f.read1(*args))

    def readline(self, *args: Any) -> Any:
        return self._add(self._f.readline(*args))

    def readlines(self, *args: Any) -> Any:
        lines = self._f.readlines(*args)
        for line in lines:
            self._add(line)
        return lines

    def readinto(self, buffer: Any) -> Any:
        n = self._f.readinto(buffer)
        self._count(n)
        return n

    def readinto1(self, buffer: Any) -> Any:
        n = self._f.readinto1(buffer)
        self._count(n)
        return n

    def __iter__(self) -> Any:
        for line in self._f:
            yield self._add(line)

    def __enter__(self) -> _CountingFile:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def count_reads_under(root: Path) -> tuple[dict[str, int], Any]:
    """Count every byte read through `open` (builtins and io, so pathlib too) from files under `root`,
    by path relative to it.

    Both code paths read checkpoint files only through Python's `open` (whole files into
    bytes, then `torch.load` from memory; DCP chunks through `open` + `readinto`; today's
    checked reads open a descriptor and then `os.fdopen`, which is `io.open` too). Returns
    the counts and a function that puts `open` back.
    """
    counts: dict[str, int] = {}
    original = builtins.open
    prefix = str(root.resolve()) + os.sep

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = original(file, mode, *args, **kwargs)
        if "r" in mode and "+" not in mode:
            if isinstance(file, int):  # os.fdopen (the checked reads open regular files by descriptor)
                try:
                    path = os.readlink(f"/proc/self/fd/{file}")
                except OSError:
                    return f
            elif isinstance(file, (str, os.PathLike)):
                path = os.path.abspath(os.fspath(file))
            else:
                return f
            if path.startswith(prefix):
                return _CountingFile(f, counts, path[len(prefix):])
        return f

    builtins.open = counting_open
    io.open = counting_open

    def undo() -> None:
        builtins.open = original
        io.open = original

    return counts, undo


# -- the job ---------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tree_local(tree: Any) -> Any:
    """DTensors replaced by their local shards (a plain torch.save of a sharded state)."""
    if isinstance(tree, torch.Tensor):
        return _local(tree)
    if isinstance(tree, dict):
        return {k: _tree_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_local(v) for v in tree)
    return tree


class Job:
    """The recipe's model, optimizer, schedule and sampler on random tokens, DDP or FSDP2 over every rank."""

    def __init__(self, opts: argparse.Namespace, ctx: WorkerContext, *, train: bool = True) -> None:
        self.opts, self.ctx = opts, ctx
        cfg = GPTConfig(block_size=opts.block_size, n_layer=opts.n_layer, n_head=opts.n_head, n_embd=opts.n_embd)
        torch.manual_seed(opts.seed)
        self.raw = GPT(cfg)
        if opts.mode == "fsdp":
            # As elastic.Run.fsdp (recipes/gpt.py --fsdp): each block, then the model; before the optimizer.
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (ctx.world_size,))
            for block in self.raw.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.raw, mesh=mesh)
            self.model: torch.nn.Module = self.raw
        elif train:
            self.model = torch.nn.parallel.DistributedDataParallel(self.raw)
        else:  # a restore loads into the model the wrapper holds: DDP plays no part (nor its import time)
            self.model = self.raw
        self.optimizer = configure_optimizer(self.raw, lr=LR, weight_decay=WEIGHT_DECAY)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(10, 1000, MIN_LR_RATIO))
        self.sampler = ElasticSampler(opts.samples, batch_size=opts.batch_size, seed=opts.seed)
        generator = torch.Generator().manual_seed(opts.seed)
        self.data = torch.randint(0, BYTE_VOCAB, (opts.samples, opts.context + 1), generator=generator)
        seed_all(opts.seed + ctx.rank, ctx.device)

    def step(self) -> None:
        window = self.data[self.sampler.local_batch(self.ctx.rank, self.ctx.world_size)]
        _, loss = self.model(window[:, :-1], window[:, 1:])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.scheduler.step()
        self.sampler.advance(self.ctx.world_size)

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds, for a plain torch.save (FSDP: this rank's shards)."""
        return _tree_local({
            "model": self.raw.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "trainer": {
                "sampler": self.sampler.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": [get_rng_state(self.ctx.device)],
            },
        })

    def manager(self) -> CheckpointManager:
        state = {"model": self.raw, "optimizer": self.optimizer, "scheduler": self.scheduler, "sampler": self.sampler}
        if SETTINGS_AS_CONFIG:
            RunConfig = _from("elastic._worker.config", "elastic.config").RunConfig  # noqa: N806

            config = RunConfig(ckpt_dir=self.opts.ckpt_dir, ckpt_every=0, ckpt_keep=2, seed=self.opts.seed, snapshot_every=0)
            return CheckpointManager(self.ctx, config, **state)
        return CheckpointManager(self.ctx, self.opts.ckpt_dir, every=0, keep=2, seed=self.opts.seed, **state)

    def fingerprint(self) -> dict[str, list[float]]:
        """(sum, sum of squares) in float64 of every model and optimizer tensor, whole (shards summed)."""
        names: dict[int, str] = {}
        for name, param in self.raw.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
        tensors = {f"model/{k}": v for k, v in self.raw.state_dict().items() if isinstance(v, torch.Tensor)}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                for key, value in self.optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"optim/{names[id(param)]}/{key}"] = value
        keys = sorted(tensors)
        sums = torch.zeros(len(keys), 2, dtype=torch.float64)
        for i, key in enumerate(keys):
            value = tensors[key]
            local = _local(value).detach().double()
            if isinstance(value, DTensor) or self.ctx.rank == 0:  # a replicated tensor counts once
                sums[i, 0], sums[i, 1] = local.sum(), (local * local).sum()
        dist.all_reduce(sums)
        return {key: sums[i].tolist() for i, key in enumerate(keys)}


def barrier() -> None:
    dist.barrier()


def time_sync_save(job: Job, directory: Path, repeats: int) -> list[float]:
    """Seconds the loop stalls for a synchronous torch.save, from a barrier to the next (no fsync).

    DDP: rank 0 saves the whole state, the others wait (a typical DDP loop);
    FSDP: every rank saves its own shards into a file of its own, in parallel.
    """
    seconds = []
    for i in range(repeats):
        path = directory / f"sync_{i}_rank{job.ctx.rank}.pt"
        if job.ctx.rank == 0:
            os.sync()  # start from clean page cache writeback, untimed
        barrier()
        started = time.perf_counter()
        if job.opts.mode == "fsdp" or job.ctx.rank == 0:
            torch.save(job.state(), path)
        barrier()
        seconds.append(time.perf_counter() - started)
        path.unlink(missing_ok=True)
    if job.ctx.rank == 0:
        os.sync()
    barrier()
    return seconds


def save_phase(opts: argparse.Namespace, ctx: WorkerContext) -> dict[str, Any]:
    job = Job(opts, ctx)
    job.step()  # allocations, lazy init; never timed
    for _ in range(opts.warmup_steps - 1):
        job.step()
    scratch = Path(opts.ckpt_dir).parent
    sync_seconds = time_sync_save(job, scratch, opts.repeats)

    # Two pre-hooks bracket the manager's (registered in between), as in checkpoint.py.
    calls: dict[int, float] = {}
    hook_wait = HookWait(job.optimizer)
    ckpt = job.manager()
    hook_wait.after_manager(calls)
    step = opts.warmup_steps
    try:
        for _ in range(opts.saves):
            for i in range(opts.every):
                if i == opts.every - 1:
                    ckpt.flush()  # untimed: each save starts with none in flight, so none is skipped
                job.step()
                step += 1
                if i == opts.every - 1:
                    barrier()  # untimed: every rank starts the save together, so no rank's wait for a peer counts
                    started = time.perf_counter()
                    ckpt.save(step)
                    calls[step] = time.perf_counter() - started
                else:
                    ckpt.maybe_save(step)
        for _ in range(opts.every):  # the last save's deferred copy overlaps these; the pre-hook may wait
            job.step()
            step += 1
            ckpt.maybe_save(step)
        ckpt.flush()
        timed_history = [dict(h) for h in ckpt.history]
        hook_wait.remove()
        ckpt.save(step, reason="final")  # untimed: the state the restore job must find
        ckpt.flush()
    finally:
        ckpt.close()
    fingerprint = job.fingerprint()
    return {
        "rank": ctx.rank,
        "tree": str(TREE),
        "parameters": sum(p.numel() for p in job.raw.parameters()),  # a DTensor's numel is the whole tensor's
        "sync_seconds": sync_seconds,
        "calls": {str(k): v for k, v in calls.items()},
        "hook_wait": {str(k): v for k, v in hook_wait.seconds.items()},
        "history": timed_history,
        "final_step": step,
        "fingerprint": fingerprint,
        "peak_rss": peak_rss(),
    }


def restore_phase(opts: argparse.Namespace, ctx: WorkerContext) -> dict[str, Any]:
    job = Job(opts, ctx, train=False)
    ckpt = job.manager()
    rss_before = current_rss()
    counts, undo = count_reads_under(Path(opts.ckpt_dir))
    barrier()
    started = time.perf_counter()
    try:
        step = ckpt.restore()
    finally:
        seconds = time.perf_counter() - started
        undo()
    peak = peak_rss()
    ckpt.close()
    checkpoint = Path(opts.ckpt_dir) / checkpoint_name(step)
    return {
        "rank": ctx.rank,
        "tree": str(TREE),
        "step": step,
        "seconds": seconds,
        "bytes_read": counts,  # by file, relative to the checkpoint root
        "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.iterdir() if f.is_file()) if step else 0,
        "restored_bytes": getattr(ckpt, "restored_bytes", None),  # the new manager's own count (tensor data)
        "rss_before": rss_before,
        "peak_rss": peak,
        "fingerprint": job.fingerprint(),
    }


def main() -> int:
    opts = build_parser().parse_args()
    torch.set_num_threads(opts.threads)
    ctx = init_worker("cpu")
    try:
        result = save_phase(opts, ctx) if opts.phase == "save" else restore_phase(opts, ctx)
        out = Path(opts.out) / f"{opts.phase}_rank{ctx.rank}.json"
        out.write_text(json.dumps(result), encoding="utf-8")
        barrier()
    finally:
        shutdown_worker()
    return 0


if __name__ == "__main__":
    status = main()
    # Every rank left the group together (barrier, shutdown_worker) and wrote its figures: end without
    # finalizing the interpreter. The gloo group can outlive destroy_process_group (torch keeps references:
    # torch.distributed.nn.functional, imported by DDP, holds it in default arguments), and a gloo thread
    # that drops its last finished collective while the interpreter finalizes aborts the process
    # ("terminate called without an active exception", exit -6): see end_worker in control_cost.py.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
