"""A run as the survivors' changes see it (elastic._worker.survivors.changes.RunHost), with nothing behind it:
the step count stands for the state, a live restore hands back the step agreed on, and every `heal` event
is kept in `emitted`. Shared by the lifecycle's tests on fakes (tests/unit) and on ranks as threads."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from elastic._worker.runtime.context import WorkerContext


class RunHostStub:
    def __init__(self, ctx: WorkerContext, step: int) -> None:
        self.ctx, self.step = ctx, step
        self.events = self.watchdog = self.checkpoints = self
        self.emitted: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.emitted.append(fields)

    def paused(self) -> Any:
        return nullcontext()

    def restore_live(self, **kwargs: Any) -> int:
        return kwargs["step"]  # the state of the agreed step, from the member that holds it

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def count_due_from(self, step: int) -> None:
        pass

    def rebuild_on_group(self, ctx: WorkerContext, earlier: Any) -> None:
        self.ctx = ctx

    def drop_group_parts(self) -> None:
        pass

    def stopping(self) -> bool:
        return False

    def forget_loss(self) -> None:
        pass
