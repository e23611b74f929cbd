"""What happened in a job, read back from its event log: rounds, interruptions, recoveries.

A *round* is one worker group's life: it begins at a `start` event (rank 0 of
a new group, after restoring) and lasts until the next `start`. A round that
begins while the previous one had not ended (no `end` event) is a
*recovery*: training stopped at the previous round's last step and went on at
this round's first step.

Invariants:
- Only the event log is read (rank 0's view, in wall-clock time); no other
  source is needed, so a report can be made from a log copied off a cluster.
- Recovery time = first step event after the new `start` - last step event of
  the round before: the wall time no step completed, which is what the job
  lost. After a SIGKILL it exceeds the fault-to-step time the chaos harness
  measures by the part of a step that was running; after a SIGTERM the
  worker finishes its step and commits it first, so it is a little shorter.
- Its cause is a heuristic on what rank 0 saw. TORCHELASTIC_RESTART_COUNT
  went up: a *failure* the agent restarted after, or a *preemption* when the
  stopped group committed a checkpoint for a SIGTERM first. It went down: a
  *relaunch* (a new torchrun resumed the job from its checkpoints). It stayed:
  a *membership change* when the world size changed or the group was stopped
  by SIGTERM (torch's agent stops a healthy group that way when a node joins),
  else a *new worker group* (a relaunch at the same count, a node replaced).
  The count is per agent and rank 0 may move between nodes, so across nodes
  the label can name the wrong one of these; the times are exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Round:
    index: int
    restart: int
    world_size: int
    start_time: float
    start_step: int
    """The step the round resumed from (its restored checkpoint; 0 for a fresh start)."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """Its step events, in order."""
    ended: bool = False
    """The round wrote an `end` event: it finished the job."""
    preempted: bool = False
    """The round committed a checkpoint for a SIGTERM (reason "preemption") before it stopped."""
    samples_per_step: int | None = None
    tokens_per_step: int | None = None


@dataclass(frozen=True)
class Recovery:
    """The gap between two rounds when the first one did not finish."""

    round: int
    """Index of the round that recovered (the second of the two)."""
    cause: str
    """"failure", "preemption", "relaunch", "membership change" or "new worker group" (see the module docstring)."""
    restart: int
    world_size_before: int
    world_size_after: int
    stopped_time: float
    """Time of the last step event before the interruption."""
    stopped_step: int
    resumed_time: float
    """Time of the first step event of the new round."""
    restored_step: int
    """The checkpoint step the new round went on from."""
    redone: int | None = None
    """The steps redone as the restore event counted them (the newest step any rank finished, from its
    progress note), when it did: the last step event can lag it by a step (the loss is read one step late,
    and a kill cuts the line short)."""

    @property
    def seconds(self) -> float:
        return self.resumed_time - self.stopped_time

    @property
    def steps_redone(self) -> int:
        """Steps finished before the interruption that were trained again (not in a checkpoint): the restore
        event's count, else the step events' (the last one logged against the step restored)."""
        return self.redone if self.redone is not None else max(0, self.stopped_step - self.restored_step)

    def describe(self) -> str:
        return (
            f"{self.cause} (restart {self.restart}): recovered in {self.seconds:.1f} s, "
            f"world size {self.world_size_before} -> {self.world_size_after}, "
            f"resumed at step {self.restored_step}, {self.steps_redone} steps redone"
        )


def rounds(events: list[dict[str, Any]]) -> list[Round]:
    """Split a job's events into rounds; events before the first `start` are ignored."""
    found: list[Round] = []
    for event in events:
        kind = event.get("event")
        if kind == "start":
            found.append(
                Round(
                    index=len(found), restart=int(event.get("restart", 0)), world_size=int(event["world_size"]),
                    start_time=float(event["time"]), start_step=int(event["step"]),
                    samples_per_step=event.get("samples_per_step"), tokens_per_step=event.get("tokens_per_step"),
                )
            )
        elif not found:
            continue
        elif kind == "step":
            found[-1].steps.append(event)
        elif kind == "end":
            found[-1].ended = True
        elif kind == "checkpoint" and event.get("reason") == "preemption":
            found[-1].preempted = True
    return found


def recoveries(events: list[dict[str, Any]]) -> list[Recovery]:
    """Every interruption the job recovered from, in order (see the module invariants)."""
    found: list[Recovery] = []
    all_rounds = rounds(events)
    last_progress: Round | None = None  # newest round that completed a step
    for current in all_rounds:
        if last_progress is not None and not last_progress.ended and current.steps and current.index > last_progress.index:
            # Rounds in between that never stepped (a failed round) are part of this gap.
            cause = interruption_cause(last_progress, current)
            stopped = last_progress.steps[-1]
            found.append(
                Recovery(
                    round=current.index, cause=cause, restart=current.restart,
                    world_size_before=last_progress.world_size, world_size_after=current.world_size,
                    stopped_time=float(stopped["time"]), stopped_step=int(stopped["step"]),
                    resumed_time=float(current.steps[0]["time"]), restored_step=current.start_step,
                    redone=_counted_redone(events, float(stopped["time"]), current.start_time),
                )
            )
        if current.steps:
            last_progress = current
    return found


def _counted_redone(events: list[dict[str, Any]], after: float, until: float) -> int | None:
    """The `redone` of the newest restore event between the interruption and the new round's start (the
    runtime writes it before `start`); None when none counted it (a checkpoint on disk only, an old log)."""
    counted = None
    for event in events:
        redone, time = event.get("redone"), event.get("time")
        if (event.get("event") == "restore" and isinstance(time, (int, float)) and after < time <= until
                and type(redone) is int and redone >= 0):
            counted = redone
    return counted


def interruption_cause(stopped: Round, resumed: Round) -> str:
    """Why the job went from `stopped` to `resumed` (a heuristic: see the module docstring)."""
    if resumed.restart < stopped.restart:
        return "relaunch"
    if resumed.restart > stopped.restart:
        return "preemption" if stopped.preempted else "failure"
    if resumed.world_size != stopped.world_size or stopped.preempted:
        # The agent stopped a healthy group (with SIGTERM, hence a preemption
        # checkpoint) because a node joined, or a node left.
        return "membership change"
    return "new worker group"


def checkpoints(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "checkpoint"]


def restores(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "restore"]
