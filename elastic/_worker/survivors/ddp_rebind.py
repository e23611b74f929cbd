"""DDP across a heal in place: a failed step is void, not an exception, and the model's
reducer is rebuilt on the next group (elastic._worker.survivors.regroup forms that group).

How a step fails without an exception reaching the training script:
- `StepGuard.attach(ddp)` replaces DDP's gradient all-reduce with one that
  catches a failed collective (a SIGKILLed peer's closed sockets fail gloo at
  once) and marks the step void instead of raising out of `loss.backward()`.
  Its arithmetic is DDP's default one (each gradient times 1/world, then a sum),
  so with DDP's default settings a run with the guard is bit-identical to one
  without (`gradient_as_bucket_view` divides instead, which rounds differently).
  Only the gradient all-reduce is guarded: a buffer broadcast, an unused-parameter
  search or a script's own collective still raises.
- `StepGuard.guard(optimizer)` makes `optimizer.step()` a no-op on a void
  step: the parameters and the optimizer state stay those of the last step
  this rank completed.

Once the next group formed, DDP's reducer is rebuilt on it (`rebind`): a fresh
bucket layout, the one a new DDP starts with, so a replacement built with
`DistributedDataParallel(..., init_sync=False)` meets the survivors bucket for bucket.

Invariants:
- A void step changed nothing this rank keeps across steps except what the
  script itself did after `optimizer.step()` (a scheduler step): the caller
  undoes that (it holds the state from before the step).
- A reducer's parameter order is the same on every member of a group (`rebind`'s
  `reverse` is every member's or none's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic._shared.common.errors import first_line as _first_line


class StepGuard:
    """Turns a failed gradient all-reduce into a void step (see the module docstring).

    `void` is set by the all-reduce of any bucket that failed and stays set until
    `clear()`: a step is void when any of its buckets failed on this rank."""

    def __init__(self) -> None:
        self.void = False
        self.error: str | None = None
        """The first failed collective's message, for the log line of the recovery."""
        self.before_reduce: Callable[[], None] = _nothing
        """Called as each bucket's all-reduce starts (a fault point: elastic._shared.protocol.fault_hook's during_all_reduce)."""

    def attach(self, model: DistributedDataParallel) -> None:
        """Reduce `model`'s gradients through this guard (again after every `rebind`)."""
        model.register_comm_hook(self, _all_reduce_or_void)

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` do nothing while the step is void (idempotent)."""
        step = optimizer.step
        if getattr(step, "guarded_by", None) is self:
            return

        @functools.wraps(step)
        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            if self.void:
                return None
            return step(*args, **kwargs)

        guarded_step.guarded_by = self  # type: ignore[attr-defined]
        optimizer.step = guarded_step  # type: ignore[method-assign]

    def failed(self, error: BaseException) -> None:
        if not self.void:
            self.error = _first_line(error)
        self.void = True

    def clear(self) -> None:
        self.void, self.error = False, None


def _all_reduce_or_void(guard, bucket):  # noqa: ANN001, ANN202 - DDP rejects a hook whose annotations are strings
    """DDP's own reduction (the bucket times 1/world, summed over ranks), a void step on failure."""
    tensor = bucket.buffer()
    if guard.void:  # an earlier bucket failed: the group is broken, do not wait on it again
        return _done(tensor)
    guard.before_reduce()
    world = dist.get_world_size()
    tensor.mul_(1.0 / world)  # DDP's default multiplies each gradient by 1/world: the same bits
    try:
        work = dist.all_reduce(tensor, async_op=True)
    except RuntimeError as error:
        guard.failed(error)
        return _done(tensor)

    def settle(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            future.value()
        except RuntimeError as error:
            guard.failed(error)
        return tensor

    return work.get_future().then(settle)


def _nothing() -> None:
    pass


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def rebind(model: DistributedDataParallel, guard: StepGuard | None = None, *, reverse: bool = False) -> None:
    """Point `model` (a DDP module) at the current default group with a fresh reducer,
    as a new `DistributedDataParallel(..., init_sync=False)` would have it, and reduce
    through `guard` again. The old reducer's gradient hooks go with it.

    `reverse`: the reducer holds the parameters in reverse definition order (the order a
    sequential model's gradients become ready in), for `settle_buckets`. A reducer's order
    must be the same on every member (a bucket is the parameters' gradients end to end):
    a fresh DDP's is the definition order, so only members that all settle reverse it."""
    model.process_group = dist.group.WORLD
    parameters, expect_sparse = model._build_params_for_reducer()
    if reverse:
        parameters, expect_sparse = parameters[::-1], expect_sparse[::-1]
    model._ddp_init_helper(
        parameters, expect_sparse, model._build_debug_param_to_name_mapping(parameters), model.static_graph
    )
    if model.static_graph:  # as torch's own rebuild (DistributedDataParallel.__setstate__)
        model.reducer._set_static_graph()
        model.logger._set_static_graph()
    model._comm_hooks = []  # the old reducer's hook goes with it
    if guard is not None:
        guard.attach(model)


def settle_buckets(model: DistributedDataParallel) -> None:
    """Do now, during a heal, the one-time work a fresh reducer would do in its first two steps: a
    collective of every member of the new group, each with a `rebind(reverse=True)` reducer. Left to torch, the
    first step reduces the whole gradient as one bucket after the backward pass (nothing overlaps)
    and the second lays the buckets out again from the order the gradients came in, broadcasting
    the layout from rank 0 first. Here the buckets are laid out by size over the reducer's order
    (reverse definition order) and the layout is broadcast from rank 0 now, so the steps
    after the heal run a steady step's all-reduces and nothing else. A reducer that never rebuilds
    (`find_unused_parameters`) or a static graph (its first step records the graph) is left as it
    is, on every member alike."""
    reducer = model.reducer
    if model.static_graph or reducer is None:
        return
    reducer._push_all_rebuilt_params()  # (nothing when the reducer does not rebuild its buckets)
    reducer._rebuild_buckets()
