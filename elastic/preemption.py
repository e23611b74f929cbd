"""Preemption: SIGTERM means "finish this step, commit a checkpoint, exit".

`kubectl delete pod`, a spot-instance reclaim or a batch scheduler send
SIGTERM and wait a grace period before SIGKILL. A worker that dies on the
signal loses every step since its last checkpoint; one that honours it loses
nothing.

Invariants:
- The handler only sets a flag; the loop acts on it at a step boundary, where
  the state is consistent.
- `requested()` is a collective: every rank calls it after every step and all
  get the same answer, so when any one rank is signalled (one pod deleted),
  the whole job checkpoints at the same step.
- A second SIGTERM restores the default action and kills the worker at once,
  for an operator (or agent) who does not want to wait.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from elastic.runtime import WorkerContext, control_group

logger = logging.getLogger(__name__)


class PreemptionHandler:
    def __init__(self, ctx: WorkerContext, signum: int = signal.SIGTERM) -> None:
        self._ctx = ctx
        self._signum = signum
        self._flag = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._flag:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self._flag = True
        logger.warning("received %s: finishing this step, then checkpointing and exiting", signal.Signals(signum).name)

    @property
    def signalled(self) -> bool:
        """Whether this process received the signal (no communication)."""
        return self._flag

    def requested(self) -> bool:
        """Whether any rank was signalled (a collective: call it on every rank at every step)."""
        if not self._ctx.distributed:
            return self._flag
        vote = torch.tensor([1 if self._flag else 0], dtype=torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=control_group())
        return bool(vote.item())

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(self._signum, self._previous)
            self._previous = None
