"""What in-memory snapshots cost the loop, snapshot by snapshot: what `--snapshot-every auto` budgets.

A snapshot's cost to the memory tier (`SnapshotCost.seconds`) is the sum of:
- capture: the loop's time in `take` at the step boundary (trainer state,
  buffers, handing the rest over), less its wait for the previous snapshot;
- waited: the loop's time waiting for it: the next optimizer step's wait (its
  deferred copy, then the rest of its write) and the next `take`'s;
- cpu: the CPU seconds its write took on the snapshot thread and the checksum
  pool up to its commit (snapshot_write.Written): on a host without an idle
  core those seconds are taken from the loop. Where cores are idle this
  over-counts, which errs towards fewer snapshots, never towards a slower loop.
Its copy to the peer node (the peer-replica tier) costs `replica_seconds`:
the CPU seconds the copy took on the snapshot thread (its tag, its send).
Not counted: the peer keeper's time to receive a replica (another node's CPU),
and the snapshot thread's waits (for the GIL, the network, the peer), which
cost the loop nothing unless it waits for them, and then `waited` holds them.

Invariants:
- A snapshot's cost is handed over once (`drain`), and only once it is
  settled: written, and seen finished by the loop, so nothing more can be
  charged to it. Costs are handed over in the order the snapshots were taken.
  A snapshot that made its slot (the first two) is not handed over: its
  one-time allocation is not what the interval budgets.
- Memory stays bounded however long the run: the newest `KEPT` records, and totals.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class SnapshotCost:
    """One snapshot's cost (see the module docstring)."""

    step: int
    capture_seconds: float = 0.0
    waited_seconds: float = 0.0
    cpu_seconds: float = 0.0
    replica_seconds: float = 0.0
    exposed_seconds: float = 0.0
    """Wall seconds from its step's end to its commit: a kill in them restores the step before."""
    write_seconds: float = 0.0
    """Wall seconds of its write on the snapshot thread (replica included): waits in it cost the loop nothing."""
    written: bool = False
    settled: bool = False
    one_time: bool = False
    """Its write made its slot (snapshot_write.Written.made_slot): not what a steady snapshot costs."""

    @property
    def seconds(self) -> float:
        return self.capture_seconds + self.waited_seconds + self.cpu_seconds


KEPT = 1024
"""Records kept for benchmarks and tests (the interval reads every cost once, through `drain`)."""


@dataclass
class SnapshotCosts:
    """Every snapshot's cost so far: the newest records, totals, and the costs not yet handed over."""

    records: deque[SnapshotCost] = field(default_factory=lambda: deque(maxlen=KEPT))
    taken: int = 0
    """Snapshots begun."""
    blocked_seconds: float = 0.0
    """The loop's time in `take`, waits for the previous snapshot included."""
    capture_seconds: float = 0.0
    step_wait_seconds: float = 0.0
    """The optimizer steps' waits."""
    _undrained: deque[SnapshotCost] = field(default_factory=deque)

    def begin(self, step: int) -> SnapshotCost:
        record = SnapshotCost(step)
        self.records.append(record)
        self._undrained.append(record)
        self.taken += 1
        return record

    def in_flight(self) -> SnapshotCost | None:
        """The newest snapshot while the loop has not seen it finish."""
        newest = self.records[-1] if self.records else None
        return newest if newest is not None and not newest.settled else None

    def waited(self, seconds: float, *, finished: bool, at_step: bool) -> None:
        """The loop waited `seconds` for the snapshot in flight (at an optimizer step when `at_step`);
        `finished`: the wait ended with that snapshot's write (done or failed)."""
        if at_step:
            self.step_wait_seconds += seconds
        record = self.in_flight()
        if record is not None:
            record.waited_seconds += seconds
            record.settled = finished

    def drain(self) -> list[tuple[float, float]]:
        """The (memory tier, peer replica) costs of the snapshots settled since the last call, in order
        (at most one is not: the newest)."""
        out = []
        while self._undrained and self._undrained[0].settled:
            record = self._undrained.popleft()
            if record.written and not record.one_time:  # a failed write has no cost to learn from (snapshots are off then)
                out.append((record.seconds, record.replica_seconds))
        return out
