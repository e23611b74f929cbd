"""Which samples a job trained on, to prove none was skipped or trained twice.

    ELASTIC_SAMPLE_LOG=runs/samples torchrevive-run ... -m elastic.chaos.samples recipes/gpt.py ARGS

runs the recipe unchanged while every rank appends one JSON line per training
step to `$ELASTIC_SAMPLE_LOG.rank<R>`: the step, the world size, the sampler's
position and the sample indices the rank trained on. It wraps the calls
every recipe of this project makes: `CheckpointManager.restore` (the step a
worker starts from), `CheckpointManager.restore_live` (the step a group formed
in place goes on from: TORCHREVIVE_SURVIVORS), `RollbackPoint.restore` (the
step every rank rolled back to after a replica check's mismatch or under
--numeric-guard rollback: a round of its own), `ElasticSampler.local_batch`
(once per step) and `NumericGuard.before_update` (a step whose update it
skipped: a line marking the step skipped).

`audit(prefix)` then rebuilds the job's history across restarts. Records
carry their round (an id rank 0 draws after each restore and broadcasts, so all
ranks of a round agree) and the step it resumed from; rounds follow each other
in time, since torchrun stops every worker of a round before the next starts,
and a group formed in place starts only once the one before it broke or was left.
A round's steps count only up to the step the next round resumed from: the
rest were lost with it and trained again. Over the steps that survive:

- rounds never trained at the same time (no split brain): a round's training ends with the last step
  every rank of its group entered (a record is written as a rank takes its step's batch; a step some
  rank never entered cannot have completed, such as the one a rank cut off from its group took after
  finishing the previous step alone);
- every step from the first to the last appears once, with one record per rank;
- each step starts where the previous one ended in the epoch stream, and
  holds exactly the samples the epoch order (`elastic._worker.data.sampler.epoch_permutation`
  of the seed) puts there;
- every complete epoch holds each sample exactly once, and no epoch holds a
  sample twice.

A skipped step's samples count as trained on (the data position moved past
them) and the audit lists the step in `skipped`: never silently lost.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import runpy
import sys
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOG_ENV = "ELASTIC_SAMPLE_LOG"


@dataclass
class SampleAudit:
    first_step: int = 0
    last_step: int = 0
    """The final history runs from `first_step` (1 for a fresh job) to `last_step`."""
    steps: int = 0
    """Steps of the final history with one record per rank."""
    samples: int = 0
    """Samples trained on in that history."""
    epochs_complete: int = 0
    skipped: list[int] = field(default_factory=list)
    """Steps of the final history whose update the numeric guard skipped (their samples were not learned from)."""
    problems: list[str] = field(default_factory=list)
    streams_compared: int = 0
    """Steps trained twice at the same world size (lost with a round, trained again after a restore) whose
    random streams at the step's start were compared, rank by rank."""
    drift: list[str] = field(default_factory=list)
    """Of those, the steps whose random streams differed: work between steps drew from them outside
    `run.pause()` (the run is no longer bit-identical to an uninterrupted one, though every sample is once).
    Not part of `ok`, which is the samples' verdict; `python -m elastic.chaos audit` fails on it."""

    @property
    def ok(self) -> bool:
        return self.steps > 0 and not self.problems

    def summary(self) -> str:
        if not self.ok:
            return "samples: " + ("; ".join(self.problems[:3]) or "no steps recorded")
        return (
            f"samples: each once (steps {self.first_step}-{self.last_step}, {self.samples} samples, "
            f"{self.epochs_complete} complete epochs"
            + (f"; step(s) {', '.join(map(str, self.skipped))} skipped by the numeric guard" if self.skipped else "")
            + (f"; random streams equal at {self.streams_compared} steps trained again" if self.streams_compared
               and not self.drift else "")
            + (f"; random streams DRIFTED at {len(self.drift)} of {self.streams_compared} steps trained again"
               if self.drift else "")
            + ")"
        )


def kept_processes(prefix: Path, since: float, until: float = float("inf")) -> int:
    """How many worker processes of the group that trained at time `since` (a fault) trained in
    every group after it too, up to time `until` (the next fault of a chain), as the records say
    (they carry each process's pid): 0 when the fault restarted every worker, the survivors'
    count when they kept their processes (TORCHREVIVE_SURVIVORS)."""
    by_round: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in read_records(prefix):
        by_round[record["round"]].append(record)
    starts = sorted((min(r["time"] for r in records), name) for name, records in by_round.items())
    before = [name for start, name in starts if start <= since]
    if not before:
        return 0
    kept = {r.get("pid", -1) for r in by_round[before[-1]]} - {-1}
    for start, name in starts:
        if since < start <= until:
            kept &= {r.get("pid", -1) for r in by_round[name]}
    return len(kept)


def _entered_by_all(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the steps that every rank of their group entered (as many ranks as the world size
    they were taken at): only those steps can have completed."""
    ranks: dict[tuple[Any, Any], set[Any]] = defaultdict(set)
    for r in records:
        ranks[(r["step"], r["world_size"])].add(r["rank"])
    return [r for r in records if len(ranks[(r["step"], r["world_size"])]) >= r["world_size"]]


def read_records(prefix: Path) -> list[dict[str, Any]]:
    records = []
    for log in sorted(prefix.parent.glob(prefix.name + ".rank*")):
        for line in log.read_text().splitlines():
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line torn by a SIGKILL: that step was lost anyway
    return records


def audit(prefix: Path) -> SampleAudit:
    """Check the sample records under `prefix` (see the module docstring)."""
    result = SampleAudit()
    rounds: dict[str, list[dict[str, Any]]] = defaultdict(list)
    skips: list[dict[str, Any]] = []
    for record in read_records(prefix):
        (skips if record.get("skipped") else rounds[record["round"]]).append(record)
    if not rounds:
        result.problems.append(f"no sample records under {prefix}")
        return result
    ordered = sorted(rounds.values(), key=lambda records: min(r["time"] for r in records))
    for before, after in zip(ordered, ordered[1:]):
        if max((r["time"] for r in _entered_by_all(before)), default=-math.inf) > min(r["time"] for r in after):
            result.problems.append(
                f"rounds resumed from steps {before[0]['round_start']} and {after[0]['round_start']} "
                "trained at the same time (two groups at once: a split brain)"
            )
    # A round's steps survive up to the earliest step any later round resumed from.
    kept: dict[int, list[dict[str, Any]]] = defaultdict(list)
    until = float("inf")
    for records in reversed(ordered):
        for r in records:
            if r["step"] <= until:
                kept[r["step"]].append(r)
        until = min(until, records[0]["round_start"])

    result.first_step = ordered[0][0]["round_start"] + 1
    result.last_step = max(kept, default=0)
    # A skip survives as its step does: recorded by the round the kept records of its step belong to.
    kept_rounds = {step: {r["round"] for r in records} for step, records in kept.items()}
    result.skipped = sorted({s["step"] for s in skips if s["round"] in kept_rounds.get(s["step"], ())})
    stream = _check_steps(kept, result)
    if stream is not None:
        _check_epochs(stream, result)
    _check_streams(ordered, kept, result)
    return result


def _check_streams(ordered: list[list[dict[str, Any]]], kept: dict[int, list[dict[str, Any]]], result: SampleAudit) -> None:
    """A step trained again after a restore (from a checkpoint or snapshot, not a group changed in place or a
    rollback) at the same world size must start from the same random streams, rank by rank, as when it was
    first trained: the checkpoint carries them, and work between steps must not move them."""
    first: dict[tuple[int, int, int], dict[str, Any]] = {}
    for records in ordered:
        for r in records:
            if r.get("rng") is not None:
                first.setdefault((r["step"], r["world_size"], r["rank"]), r)
    for step, records in sorted(kept.items()):
        compared = drifted = False
        for r in records:
            before = first.get((step, r["world_size"], r["rank"]))
            if r.get("round_kind", "restore") != "restore" or before is None or before is r or r.get("rng") is None:
                continue
            compared = True
            drifted |= before["rng"] != r["rng"]
        result.streams_compared += compared
        if drifted:
            result.drift.append(f"step {step}: trained again after a restore from other random streams than when first "
                                "trained (work between steps drew from them outside run.pause()?)")


def _check_steps(kept: dict[int, list[dict[str, Any]]], result: SampleAudit) -> _Stream | None:
    """Each step: one record per rank, starting where the step before ended, holding
    exactly the samples the epoch order puts there. The samples in order, or None
    when a step is missing (the epochs cannot be cut then)."""
    stream: _Stream | None = None
    position: tuple[int, int] | None = None
    orders: dict[int, list[int]] = {}
    for step in range(result.first_step, result.last_step + 1):
        ranks = sorted(kept.get(step, []), key=lambda r: r["rank"])
        world = ranks[0]["world_size"] if ranks else 0
        if not ranks or [r["rank"] for r in ranks] != list(range(world)):
            result.problems.append(f"step {step}: records of ranks {[r['rank'] for r in ranks]}, not one per rank")
            return None
        first = ranks[0]
        n, batch, seed = first["num_samples"], first["batch_size"], first["seed"]
        here = (first["epoch"], first["consumed"])
        if position is not None and here != position:
            result.problems.append(f"step {step} starts at (epoch, consumed) {here}; the step before ended at {position}")
        trained = [i for r in ranks for i in r["indices"]]
        expected = _stream_slice(orders, n, seed, here, batch * world)
        if trained != expected:
            wrong = sum(a != b for a, b in zip(trained, expected)) + abs(len(trained) - len(expected))
            result.problems.append(f"step {step}: {wrong} of its samples are not those the epoch order puts at {here}")
        position = divmod(here[0] * n + here[1] + batch * world, n)
        if stream is None:
            stream = _Stream(start=here, num_samples=n)
        stream.indices += trained
        result.steps += 1
    return stream


@dataclass
class _Stream:
    start: tuple[int, int]
    """(epoch, consumed) where the history begins: (0, 0) for a fresh job."""
    num_samples: int
    indices: list[int] = field(default_factory=list)


def _stream_slice(orders: dict[int, list[int]], n: int, seed: int, at: tuple[int, int], count: int) -> list[int]:
    """`count` indices of the epoch stream from position `at`, as the sampler defines it."""
    from elastic._worker.data.sampler import epoch_permutation

    out: list[int] = []
    epoch, consumed = at
    while len(out) < count:
        if epoch not in orders:
            orders[epoch] = epoch_permutation(n, seed, epoch).tolist()
        take = min(count - len(out), n - consumed)
        out += orders[epoch][consumed : consumed + take]
        epoch, consumed = epoch + 1, 0
    return out


def _check_epochs(stream: _Stream, result: SampleAudit) -> None:
    """No epoch holds a sample twice; complete ones hold every sample."""
    n = stream.num_samples
    epoch, cut = stream.start[0], n - stream.start[1]
    pieces = [(epoch, stream.indices[:cut], stream.start[1] == 0)]
    for begin in range(cut, len(stream.indices), n):
        epoch += 1
        pieces.append((epoch, stream.indices[begin : begin + n], True))
    for epoch, piece, from_start in pieces:
        repeated = len(piece) - len(set(piece))
        if repeated:
            result.problems.append(f"epoch {epoch}: {repeated} samples trained twice")
        elif from_start and len(piece) == n:
            if set(piece) != set(range(n)):
                result.problems.append(f"epoch {epoch}: holds indices outside 0..{n - 1}")
            else:
                result.epochs_complete += 1
    result.samples = len(stream.indices)


# --- the recording wrapper ----------------------------------------------------------


def append_record(prefix: str | Path, rank: int, record: dict[str, Any]) -> None:
    """One write per record, starting with a newline: a line torn by a SIGKILL
    never swallows the next round's first record."""
    fd = os.open(f"{prefix}.rank{rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, ("\n" + json.dumps(record)).encode())
    finally:
        os.close(fd)


def streams_digest() -> str:
    """A digest of this process's random streams that a checkpoint carries (python, numpy, torch CPU)."""
    import random

    import numpy as np
    import torch

    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8)
    digest.update(np.asarray(random.getstate()[1], dtype=np.uint64).tobytes())
    digest.update(np.random.get_state(legacy=True)[1].tobytes())
    return digest.hexdigest()


def _record_samples(prefix: str) -> None:
    """Patch the sampler and state manager of this process to log every step."""
    import torch.distributed as dist

    from elastic._worker.checkpoint import CheckpointManager
    from elastic._worker.data.sampler import ElasticSampler
    from elastic._worker.integrity.numeric_guard import NumericGuard
    from elastic._worker.integrity.rollback import RollbackPoint
    from elastic._worker.runtime.context import control_group

    current: dict[str, Any] = {"step": 1, "round": "", "round_start": 0, "round_kind": "restore"}
    original_restore, original_local_batch = CheckpointManager.restore, ElasticSampler.local_batch
    original_restore_live = CheckpointManager.restore_live
    original_rollback, original_before_update = RollbackPoint.restore, NumericGuard.before_update

    def new_round(resumed: int, kind: str) -> int:
        round_id = [uuid.uuid4().hex]
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(round_id, src=0, group=control_group())
        current.update(step=resumed + 1, round=round_id[0], round_start=resumed, round_kind=kind)
        return resumed

    def restore(self: CheckpointManager) -> int:
        return new_round(original_restore(self), "restore")

    def restore_live(self: CheckpointManager, **kwargs: Any) -> int:
        return new_round(original_restore_live(self, **kwargs), "live")  # a group changed in place: a round of its own

    def rollback(self: RollbackPoint) -> int:
        return new_round(original_rollback(self), "rollback")  # every rank rolls back at the same step: its own round

    def before_update(self: NumericGuard, step: int, *args: Any, **kwargs: Any) -> str | None:
        action = original_before_update(self, step, *args, **kwargs)
        if action is not None:  # skipped (rollback: skipped, and trained again from the point, skipped then too)
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            append_record(prefix, rank, {"skipped": True, "step": step, "round": current["round"],
                                         "time": time.time(), "rank": rank, "action": action})
        return action

    def local_batch(self: ElasticSampler, rank: int, world_size: int):
        indices = original_local_batch(self, rank, world_size)
        record = {
            "step": current["step"], "round": current["round"], "round_start": current["round_start"],
            "time": time.time(), "rank": rank, "world_size": world_size, "pid": os.getpid(),
            "epoch": self.state.epoch, "consumed": self.state.consumed, "num_samples": self.num_samples,
            "batch_size": self.batch_size, "seed": self.seed, "indices": indices.tolist(),
            "round_kind": current.get("round_kind", "restore"), "rng": streams_digest(),
        }
        current["step"] += 1
        append_record(prefix, rank, record)
        return indices

    CheckpointManager.restore = restore  # type: ignore[method-assign]
    CheckpointManager.restore_live = restore_live  # type: ignore[method-assign]
    ElasticSampler.local_batch = local_batch  # type: ignore[method-assign]
    RollbackPoint.restore = rollback  # type: ignore[method-assign]
    NumericGuard.before_update = before_update  # type: ignore[method-assign]


def main() -> None:
    if len(sys.argv) < 2 or not os.environ.get(LOG_ENV):
        print(f"usage: {LOG_ENV}=PREFIX python -m elastic.chaos.samples RECIPE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    recipe = os.path.abspath(sys.argv[1])
    if not os.path.isfile(recipe):
        print(f"python -m elastic.chaos.samples: error: recipe {sys.argv[1]} does not exist", file=sys.stderr)
        sys.exit(2)
    _record_samples(os.environ[LOG_ENV])
    sys.argv = [recipe, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(recipe))
    runpy.run_path(recipe, run_name="__main__")


if __name__ == "__main__":
    main()
