"""Restore from an in-memory snapshot versus from the checkpoint on disk, and what a snapshot costs the loop.

    python benchmarks/snapshot_restore.py           # the recovery benchmark's tiny GPT and a ~100M GPT, ~2 min on 2 cores
    python benchmarks/snapshot_restore.py --quick   # the tiny GPT only, one repeat (smoke test; figures mean little)

One process, no torchrun: per model the benchmark starts a snapshot keeper
(`elastic._agent.launcher.keeper.SnapshotKeeper`, on 127.0.0.1, its directory in a
temporary folder under /dev/shm) in this process and puts its address in the
environment, as `torchrevive-run` does for its workers (a keeper per model: a
restore is offered every part of its run id a keeper holds, and the other
model's would be tried first). Per model:

1. Build the model the way recipes/gpt.py does (AdamW from
   `configure_optimizer`, gradient clipping at 1.0, the elastic sampler) on
   random tokens, and a `CheckpointManager` with `snapshot_every=1` and no
   periodic checkpoints. Three untimed steps (the first allocates AdamW's
   state; the next two take a snapshot each, which allocate the two snapshot
   slots), then `--steps` steps without snapshots and `--steps` with one each
   (`maybe_save`), in alternating blocks of `--block` steps, so that a change
   of the machine's speed hits both alike; the snapshot work still running at
   the end of a block with snapshots is waited for and charged to that
   block's last step. Per snapshot, the loop's blocking seconds are the
   manager's own `memory.costs` records' `capture_seconds` (the trainer
   state, the copy of the buffers; the deferred copy of parameters and
   optimizer state runs on the snapshot thread, and whatever of it the next
   optimizer step still waits for lands in that step's time: it shows in
   "step on/off", as does the snapshot thread's competition for the cores).
   Target: median blocking / median step time without snapshots <= 0.02.
2. The newest snapshot is whole (`wait_previous`); a durable
   `save(step, reason="final")` + `flush()` of the same step goes to a
   checkpoint directory on disk (the system temp dir, `--dir`).
3. `--repeats` times, each with a fresh model, optimizer, sampler and manager
   (as a restarted worker would have), timed around `restore()`: from memory
   (`snapshot_every=1`: the keeper's parts, crc32c checked), from disk with the
   checkpoint in the page cache (`snapshot_every=0`; what a restarted worker on
   the same machine finds right after the save), and from disk cold (the
   checkpoint's pages dropped first with posix_fadvise(DONTNEED): what a
   replacement node reads; on a virtual disk the host may still cache them),
   the three in a rotating order. The restore event's `source` must say memory or
   disk, and the restored model and optimizer state must equal what was
   trained (crc32c of every tensor): "state" says ok or MISMATCH. Medians are
   printed, and disk / memory ratios.

Models: "tiny", the GPT of benchmarks/recovery.py (2 layers x 64 wide, 2
heads, context 32, batch 8); "100m", the ~100M GPT of
benchmarks/checkpoint.py (14 layers x 768 wide, 12 heads; 99.5M parameters at
context 64, about 1.2 GB of parameters and AdamW state) trained on `--context-100m` 64
tokens x `--batch-100m` 2 sequences, so that a CPU step takes seconds, not
tens of seconds (the snapshot holds the same bytes whatever the batch; a
shorter step only leaves less time to hide the deferred copy behind, so the
fraction is the conservative one).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "benchmarks"))  # its siblings, by plain name

from common import memory_dir  # noqa: E402
from gpt_model import BYTE_VOCAB, GPT, GPTConfig, configure_optimizer  # noqa: E402

from elastic._agent.launcher.keeper import SnapshotKeeper  # noqa: E402
from elastic._shared.storage.job_secret import made_on_this_host  # noqa: E402
from elastic._shared.common.cli import OneLineArgumentParser, positive_int  # noqa: E402
from elastic._worker.checkpoint import CheckpointManager  # noqa: E402
from elastic._worker.config import RunConfig  # noqa: E402
from elastic._worker.data.sampler import ElasticSampler  # noqa: E402
from elastic._worker.observe.events import EventLog, read_events  # noqa: E402
from elastic._worker.runtime.context import init_worker  # noqa: E402

TARGET = 0.02
LR, WEIGHT_DECAY, GRAD_CLIP = 1e-3, 0.1, 1.0  # recipes/gpt.py defaults
SOURCES = ("memory", "disk (cached)", "disk (cold)")


@dataclass(frozen=True)
class Model:
    name: str
    cfg: GPTConfig
    batch_size: int
    steps: int
    """Timed steps without snapshots, and as many with."""


def models(opts: argparse.Namespace) -> list[Model]:
    tiny = Model("tiny", GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=64), batch_size=8, steps=40)
    big = Model("100m", GPTConfig(block_size=opts.context_100m, n_layer=14, n_head=12, n_embd=768),
                batch_size=opts.batch_100m, steps=4)
    return [tiny] if opts.quick else {"tiny": [tiny], "100m": [big], "both": [tiny, big]}[opts.models]


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="snapshot_restore.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", choices=("tiny", "100m", "both"), default="both")
    p.add_argument("--repeats", type=positive_int, default=5, help="restores per source (median reported)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="timed training steps without snapshots, and as many with (default: 40 tiny, 4 100m)")
    p.add_argument("--block", type=positive_int, default=2,
                   help="steps per block: blocks without and with snapshots alternate")
    p.add_argument("--context-100m", type=positive_int, default=64, help="tokens per sequence of the 100m model's steps")
    p.add_argument("--batch-100m", type=positive_int, default=2, help="sequences per step of the 100m model")
    p.add_argument("--dir", default=None, help="where the checkpoint directory goes (default: the system temp dir)")
    p.add_argument("--quick", action="store_true", help="the tiny model only, 1 repeat, 2 steps each (smoke test)")
    return p


class Trainer:
    """The recipe's model and optimizer on random tokens, with a manager of its own."""

    def __init__(self, model: Model, ctx: Any, ckpt_dir: Path, events: Path, snapshot_every: int) -> None:
        torch.manual_seed(0)
        self.net = GPT(model.cfg)
        self.optimizer = configure_optimizer(self.net, lr=LR, weight_decay=WEIGHT_DECAY)
        self.sampler = ElasticSampler(256, batch_size=model.batch_size, seed=0)
        self.data = torch.randint(0, BYTE_VOCAB, (256, model.cfg.block_size + 1))
        self.events = EventLog(events, restart=0)
        self.manager = CheckpointManager(
            ctx, RunConfig(ckpt_dir=ckpt_dir, ckpt_every=0, ckpt_keep=2, snapshot_every=snapshot_every),
            model=self.net, optimizer=self.optimizer, sampler=self.sampler, events=self.events,
        )

    def step(self) -> float:
        started = time.perf_counter()
        window = self.data[self.sampler.local_batch(0, 1)]
        _, loss = self.net(window[:, :-1], window[:, 1:])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), GRAD_CLIP)
        self.optimizer.step()
        self.sampler.advance(1)
        return time.perf_counter() - started

    def fingerprint(self) -> dict[str, int]:
        """crc32c of every model tensor and optimizer state tensor, by name."""
        out = {f"model/{k}": _crc(v) for k, v in self.net.state_dict().items()}
        names = {id(p): n for n, p in self.net.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                out[f"optim/{names[id(param)]}/{key}"] = _crc(value)
        return out

    def close(self) -> None:
        self.manager.close()
        self.events.close()


def _crc(tensor: torch.Tensor) -> int:
    return crc32c.crc32c(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def drop_page_cache(directory: Path) -> None:
    """Drop the clean cached pages of every file under `directory` (this benchmark's own files only)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def last_restore(events: Path) -> dict[str, Any]:
    found = [e for e in read_events(events) if e["event"] == "restore"]
    if not found:
        raise RuntimeError("the manager restored without a restore event")
    return found[-1]


def timed_steps(trainer: Trainer, steps: int, block: int, start: int) -> tuple[list[float], list[float], int]:
    """`steps` steps without snapshots and `steps` with one each, in alternating blocks of `block`
    (a change of machine speed hits both alike). The snapshot thread's work left at the end of a
    block with snapshots is waited for and charged to that block's last step, so the next block
    without snapshots starts clean. Returns (seconds without, seconds with, the last step)."""
    memory = trainer.manager.memory
    assert memory is not None
    off: list[float] = []
    on: list[float] = []
    step = start
    while len(on) < steps:
        for _ in range(min(block, steps - len(off))):
            off.append(trainer.step())
            step += 1
        for i in range(min(block, steps - len(on))):
            started = time.perf_counter()
            trainer.step()
            step += 1
            trainer.manager.maybe_save(step)
            if i == block - 1 or len(on) == steps - 1:
                memory.wait_previous()
            on.append(time.perf_counter() - started)
    return off, on, step


def measure(model: Model, opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    ctx = init_worker("cpu", environ=dict(os.environ))  # with the keeper's address, as its workers get it
    ckpt_dir = tmp / f"ckpt-{model.name}"
    events = tmp / f"{model.name}.jsonl"
    trainer = Trainer(model, ctx, ckpt_dir, events, snapshot_every=1)
    memory = trainer.manager.memory
    if memory is None:
        raise RuntimeError("the manager found no snapshot keeper: KeeperAddress.from_env() is None")
    parameters = sum(p.numel() for p in trainer.net.parameters())
    if trainer.manager.restore() != 0:
        raise RuntimeError(f"{ckpt_dir} was not empty")
    trainer.step()  # allocations, lazy init, AdamW state: not timed
    for step in (2, 3):  # the first two snapshots allocate the two slots: not timed
        trainer.step()
        trainer.manager.maybe_save(step)
    memory.wait_previous()
    off, on, step = timed_steps(trainer, opts.steps or model.steps, opts.block, 3)
    memory.wait_previous()
    if memory.disabled is not None:
        raise RuntimeError(f"snapshots turned off: {memory.disabled}")
    blocking = [r.capture_seconds for r in memory.costs.records if r.step > 3]  # steps 2 and 3: untimed
    snapshot_bytes = memory.slot_bytes
    trainer.manager.save(step, reason="final")
    trainer.manager.flush()
    expected = trainer.fingerprint()
    trainer.close()
    del trainer, memory
    gc.collect()

    seconds: dict[str, list[float]] = {source: [] for source in SOURCES}
    ok = True
    for repeat in range(opts.repeats):
        for source in SOURCES[repeat % 3:] + SOURCES[: repeat % 3]:  # each source first in turn
            if source == "disk (cold)":
                drop_page_cache(ckpt_dir)
            fresh = Trainer(model, ctx, ckpt_dir, events, snapshot_every=1 if source == "memory" else 0)
            started = time.perf_counter()
            restored = fresh.manager.restore()
            seconds[source].append(time.perf_counter() - started)
            event = last_restore(events)
            want = "memory" if source == "memory" else "disk"
            if restored != step or event["source"] != want:
                raise RuntimeError(f"{model.name}: restoring from {want} gave step {restored} from {event['source']}")
            ok = ok and fresh.fingerprint() == expected
            fresh.close()
            del fresh
            gc.collect()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return {
        "parameters": parameters,
        "snapshot_mb": snapshot_bytes / 2**20,
        "restore": {source: statistics.median(v) for source, v in seconds.items()},
        "step_off": statistics.median(off),
        "step_on": statistics.median(on),
        "steps": len(off),
        "blocking": statistics.median(blocking),
        "blocking_max": max(blocking),
        "ok": ok,
    }


def with_keeper(base: Path, run: Any) -> Any:
    """`run()` with a snapshot keeper of its own in this process, its address in the environment
    (as torchrevive-run gives its workers); the keeper and the environment go afterwards."""
    secret = made_on_this_host("snapshot-restore", base)
    key, secret_file = secret.key, secret.made_here
    keeper = SnapshotKeeper("127.0.0.1", key=key, run_id="snapshot-restore", base=base, secret_file=secret_file)
    saved = {k: os.environ.get(k) for k in keeper.address.environ()}
    os.environ.update(keeper.address.environ())
    try:
        return run()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        keeper.close()


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    if opts.quick:
        opts.repeats, opts.steps = 1, opts.steps or 2
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="snapshot-keeper-", dir=memory_dir()) as base, \
            tempfile.TemporaryDirectory(prefix="snapshot-restore-", dir=opts.dir) as tmp:
        for model in models(opts):
            print(f"{model.name}: measuring ...", flush=True)
            # A keeper per model: the parts of one model's job are not another's to find.
            results[model.name] = with_keeper(Path(base), lambda m=model: measure(m, opts, Path(tmp)))
    report(results, opts.repeats)
    return 0 if all(r["ok"] for r in results.values()) else 1


def report(results: dict[str, dict[str, Any]], repeats: int) -> None:
    """The table and the lines per model from `measure`'s figures: restore seconds by source and their
    ratios, the snapshot's blocking against the step (and the target's verdict), the restored state's check."""
    print()
    print(f"restore seconds: median of {repeats}; snapshot blocking and step seconds: medians over the timed steps")
    print(f"{'model':6} {'params':>7} {'state MB':>9} {'memory s':>9} {'disk s':>8} {'cold s':>8} "
          f"{'disk/mem':>9} {'cold/mem':>9} {'block ms':>9} {'step s':>8} {'block/step':>11} {'step on/off':>12} {'state':>6}")
    for name, r in results.items():
        mem, disk, cold = (r["restore"][s] for s in SOURCES)
        print(
            f"{name:6} {r['parameters'] / 1e6:6.1f}M {r['snapshot_mb']:9.1f} {mem:9.3f} {disk:8.3f} {cold:8.3f} "
            f"{disk / mem:8.1f}x {cold / mem:8.1f}x {r['blocking'] * 1e3:9.2f} {r['step_off']:8.3f} "
            f"{r['blocking'] / r['step_off']:11.4f} {r['step_on'] / r['step_off']:12.2f} {'ok' if r['ok'] else 'MISMATCH':>6}"
        )
    print()
    for name, r in results.items():
        mem, disk, cold = (r["restore"][s] for s in SOURCES)
        fraction = r["blocking"] / r["step_off"]
        print(f"{name}: restore from memory {mem:.3f} s, from disk {disk:.3f} s (page cache), {cold:.3f} s (cold); "
              f"disk/memory {disk / mem:.1f}x, cold/memory {cold / mem:.1f}x")
        print(f"{name}: snapshot blocking {r['blocking'] * 1e3:.2f} ms (max {r['blocking_max'] * 1e3:.2f}) per step of "
              f"{r['step_off']:.3f} s: {fraction:.4f} (target <= {TARGET}: {'met' if fraction <= TARGET else 'MISSED'}); "
              f"step with a snapshot every step / without: {r['step_on'] / r['step_off']:.2f} ({r['steps']} steps each)")


if __name__ == "__main__":
    sys.exit(main())
