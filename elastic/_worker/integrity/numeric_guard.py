"""The numeric guard: a non-finite loss or gradient norm, or a loss spike, caught before the
optimizer step applies it, and what every rank then does (`--numeric-guard`).

The runtime sees each step just before its update through a pre-hook on the
optimizer step (the body's `optimizer.step()` calls it after backward, the
gradient all-reduce and any clipping): it reads the gradient norm of every
parameter the optimizer holds and the loss the script logged for this step
(`run.log(loss)` before `optimizer.step()`; logged after it, the loss is not
known yet and only the gradient norm is read). A reading is bad when either
is not finite, or (with `--loss-spike F` above 0) when the loss exceeds F
times the median of the last `WINDOW` good losses.

Policies: `off`; `stop` (every rank raises `NumericFault`, one line, exit
`NUMERIC_STOP_EXIT`, before the update: the last checkpoint is clean);
`skip` (the update is not applied: every gradient is dropped, so the
optimizer's step changes nothing; the step counts as done, its batch is
recorded as skipped); `rollback` (the update is not applied, every rank rolls
back to the rollback point, elastic._worker.integrity.rollback, and replays;
the caught step is judged once more: bad again, the `batch` is at fault and
its update is skipped; good, the fault was `transient` and the step is applied,
so the run ends bit-identical to one that never saw it).

Invariants:
- Every rank takes the same decision at the same step: each judges its own
  reading, and the verdicts meet in one small all-reduce (MAX) on the control
  group, so a NaN only one rank's loss shows, or a spike in one rank's loss,
  is acted on by all.
- A skipped step stays skipped: the guard's state (the steps it skipped) is
  part of every checkpoint, and a run resumed from one skips them again
  without judging them, on every rank alike.
- Decisions depend only on the readings and the window (`judge` is pure).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from elastic._shared.common.errors import ElasticError

OFF, STOP, SKIP, ROLLBACK = "off", "stop", "skip", "rollback"
BATCH, TRANSIENT = "batch", "transient"
"""What a step caught under rollback was, once its replay was judged (verdicts.BATCH and verdicts.TRANSIENT)."""
POLICIES = (OFF, STOP, SKIP, ROLLBACK)
WINDOW = 50
"""Good losses the spike threshold compares with (their median)."""
MIN_WINDOW = 10
"""Good losses needed before a spike can be called."""
NUMERIC_STOP_EXIT = 81
"""The job stopped on a non-finite or spiking step under --numeric-guard stop (distinct from 1, 2, 75-80, 124, 143)."""
STATE_NAME = "torchrevive.numeric_guard"
"""Its name among a checkpoint's extra objects (a runtime-owned one: elastic._worker.checkpoint.fit)."""
MAX_SKIPPED = 1 << 16


class NumericFault(ElasticError):
    """A bad step under --numeric-guard stop."""

    exit_code = NUMERIC_STOP_EXIT


@dataclass(frozen=True)
class Reading:
    """What the guard reads of one step before its update."""

    grad_norm: float
    loss: float | None
    """None: the script logs its loss after the optimizer step."""


def judge(reading: Reading, window: list[float], spike: float) -> tuple[str, float] | None:
    """(why, the value) when `reading` is bad; None when it is good. `window`: recent good losses."""
    if reading.loss is not None and not math.isfinite(reading.loss):
        return "non-finite loss", reading.loss
    if not math.isfinite(reading.grad_norm):
        return "non-finite gradient norm", reading.grad_norm
    if spike > 0 and reading.loss is not None and len(window) >= MIN_WINDOW:
        median = statistics.median(window)
        if median > 0 and reading.loss > spike * median:
            return f"loss spike (over {spike:g} x the median {median:.4g} of the last {len(window)} steps)", reading.loss
    return None


def grad_norm(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of every gradient the optimizer holds (a scalar tensor; 0 when there is none)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this rank's shard
    return torch.nn.utils.get_total_norm(local).float().cpu()


class NumericGuard:
    """One rank's guard (see the module docstring). `agree(bad)`: whether any rank's reading was bad
    (a collective); `record(step, why, value, action)`: what to say about a bad step."""

    def __init__(self, policy: str, *, spike: float, agree: Callable[[bool], bool]) -> None:
        if policy not in POLICIES:
            raise ValueError(f"numeric guard policy {policy!r} is not one of {POLICIES}")
        self.policy = policy
        self.spike = spike
        self._agree = agree
        self._window: deque[float] = deque(maxlen=WINDOW)
        self.skipped: set[int] = set()
        """Steps whose update was not applied (steps numbered from 1: step N is the N-th update)."""
        self.rollback_due: int | None = None
        """The step whose bad reading asks for a rollback at its end (policy rollback)."""
        self.caught: list[dict[str, Any]] = []
        self.replaying: int | None = None
        """`rollback`: the caught step its replay judges once more (its verdict is then `batch` or `transient`)."""
        self.outcome: str | None = None
        """The kind the last replay judged (`batch` or `transient`), until read (`take_outcome`)."""

    @property
    def on(self) -> bool:
        return self.policy != OFF

    def before_update(self, step: int, parameters: list[torch.Tensor], loss: torch.Tensor | None) -> str | None:
        """Step `step` is about to be applied: None to apply it, else the action taken (`skip` or
        `rollback`: every gradient dropped, the update changes nothing); `stop` raises."""
        if step in self.skipped and step != self.replaying:  # skipped before (a resumed run; a batch): again, unjudged
            _drop_gradients(parameters)
            return SKIP
        if not self.on:  # the record above serves replica checks too (a batch they found at fault)
            return None
        reading = Reading(float(grad_norm(parameters)), float(loss.detach().float().cpu()) if loss is not None else None)
        verdict = judge(reading, list(self._window), self.spike)
        bad = self._agree(verdict is not None)
        why, value = verdict if verdict is not None else ("a peer's reading", math.nan)
        if step == self.replaying:  # the replay of a step caught under rollback: what was at fault
            self.replaying = None
            self.outcome = BATCH if bad else TRANSIENT
            if not bad:
                self.skipped.discard(step)
                return None
            _drop_gradients(parameters)
            self.caught.append({"step": step, "why": why, "value": value, "action": SKIP, "kind": BATCH})
            return SKIP
        if not bad:
            if reading.loss is not None:
                self._window.append(reading.loss)
            return None
        self.caught.append({"step": step, "why": why, "value": value, "action": self.policy})
        if self.policy == STOP:
            raise NumericFault(f"step {step}: {why} ({value:g}) before the update; --numeric-guard stop")
        _drop_gradients(parameters)
        if len(self.skipped) < MAX_SKIPPED:
            self.skipped.add(step)
        if self.policy == ROLLBACK:
            self.rollback_due = self.replaying = step
        return self.policy

    def take_outcome(self) -> str | None:
        outcome, self.outcome = self.outcome, None
        return outcome

    # -- its state in a checkpoint (an extra object) --------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": sorted(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        skipped = state.get("skipped") if isinstance(state, dict) else None
        if not isinstance(skipped, list) or len(skipped) > MAX_SKIPPED or any(
                type(s) is not int or s < 1 for s in skipped):
            raise ValueError(f"the numeric guard's state holds no list of skipped steps: {str(state)[:80]}")
        self.skipped = set(skipped)


def _drop_gradients(parameters: list[torch.Tensor]) -> None:
    """The update changes nothing: optimizers leave a parameter without a gradient as it is (its
    moments, its step count, its weight decay)."""
    for p in parameters:
        p.grad = None
