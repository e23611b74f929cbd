"""Restoring from a live peer: the catch-up of a heal in place (elastic._worker.survivors.healing).

The members of a group formed in place hold different states: a survivor the
state of the last step it completed, a replacement only what its script built
(the model as seeded, an empty optimizer). One member, the source (the lowest
rank of those that completed the most steps: `elastic._worker.survivors.catch_up.agree`), sends
its whole training state over the new group, as a checkpoint would hold it:

1. a header, the source's `torch.save` of plain values: every tensor's stable
   key, shape and dtype (`state.live_tensors`), and the trainer state (step,
   sampler position, scheduler, scaler, extra objects, optimizer settings,
   modules' extra state);
2. every tensor, in the header's order, packed into flat buffers of one dtype and
   at most `flat_broadcast.BUCKET_BYTES` each (a larger tensor alone): one broadcast per
   buffer, not per tensor (a small model's state is some 200 tensors, and as
   many broadcasts cost a heal 0.1 s of round trips).

Invariants:
- Nothing is unpickled: the header loads with `weights_only=True` and every
  field of it is checked (types, sizes, the model's keys and shapes, the
  optimizer's groups) before anything live changes; a header over
  `MAX_HEADER_BYTES` is refused before it is received.
- Nothing is allocated at a size a peer chose: before the first receive
  buffer, every tensor the header names (each once) has the shape and dtype of
  the local tensor it will be loaded into: a model tensor its own; an
  optimizer tensor the optimizer's state for that parameter where it holds
  one (a survivor: the same names, shapes and dtypes), else (a replacement's
  fresh optimizer) its parameter's shape in the parameter's dtype or float32,
  or a scalar, at most `MAX_STATES_PER_PARAMETER` per parameter. So a
  member receives at most that many times its model's size; anything else is
  a `LivePeerError` (the heal fails in one line, and a new round restores).
- A member that already holds the source's step (`take=False`) changes
  nothing; it only takes part in the broadcasts (they are collectives).
- A replacement's RNG is seeded from (seed, step, rank), as a rank a grown
  job has no saved state for (`TrainingState.apply_trainer`): its random
  stream (dropout) is not the dead worker's. A survivor keeps its own.
- Only plain (replicated) tensors travel: a sharded (FSDP2) model has no live
  source here; its shards are restored from a snapshot or the disk.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic._shared.common.errors import CheckpointMismatchError, ElasticError
from elastic._shared.protocol import heal_env
from elastic._worker.checkpoint import flat_broadcast
from elastic._worker.checkpoint import state as live_state
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.runtime.rng import get_rng_state, set_rng_state

MAX_HEADER_BYTES = 64 << 20
"""A header is a few KB (a name, a shape and a dtype per tensor, plus the trainer state); 64 MiB is
far past any real one, and bounds what a broken peer can make this worker allocate."""
MAX_STATES_PER_PARAMETER = 8
"""Tensors of optimizer state per parameter a member with no state of its own for it accepts (Adam
with amsgrad keeps 4: step, exp_avg, exp_avg_sq, max_exp_avg_sq)."""


class LivePeerError(ElasticError):
    """The source's header is malformed or does not fit this run (one line). The worker exits with
    the status of a heal that did not form: its agent then takes a new round (a restore)."""

    exit_code = heal_env.HEAL_FAILED_EXIT


@dataclass(frozen=True)
class Received:
    """What a member took from the source."""

    step: int
    """The source's step: where every member goes on from."""
    bytes_received: int
    """Bytes this member received (0 when it held the source's step already)."""
    extras: dict[str, Any]
    """The source's `extras` (the caller's own plain values, e.g. the checkpoint tag)."""


def share(
    ctx: WorkerContext, state: TrainingState, *, source: int, step: int, take: bool, extras: dict[str, Any],
    replacement: bool, fault: Callable[[str, int], None] = lambda point, step: None,
) -> Received:
    """Make this member's state the source's (see the module docstring); a collective on the default group.

    `step`: the source's completed steps (every member learned it from `catch_up.agree`);
    `take`: this member applies what it receives; `extras`: plain values the source sends
    along (ignored elsewhere); `replacement`: this member's RNG is seeded, not kept."""
    if any(isinstance(t, DTensor) for t in state.model.state_dict().values()):
        raise LivePeerError("a sharded (FSDP2) model has no live source: restore it from a snapshot or the disk")
    is_source = ctx.rank == source
    tensors = state.layout.tensors() if is_source else {}
    header = _receive_header(_encode_header(state, step, tensors, extras) if is_source else None, source)
    entries, trainer, extras_received = _check_header(header, step)
    if not is_source:
        _check_fits(state, entries, trainer, source)
    if not is_source:
        fault("during_catch_up", step)
    # Receivers get fresh tensors of the checked shapes (a copy each: nothing is a view of a buffer).
    received = {key: torch.empty(shape, dtype=dtype) for key, shape, dtype in entries} if not is_source else {}
    flat_broadcast.broadcast(
        [tensors[key].detach().cpu() if is_source else received[key] for key, _, _ in entries], source, rank=ctx.rank
    )
    if is_source or not take:
        return Received(step=step, bytes_received=0, extras=extras_received)
    _apply(ctx, state, step, received, trainer, replacement=replacement)
    size = sum(t.numel() * t.element_size() for t in received.values())
    return Received(step=step, bytes_received=size, extras=extras_received)


Entry = tuple[str, torch.Size, torch.dtype]


def _encode_header(state: TrainingState, step: int, tensors: dict[str, torch.Tensor], extras: dict[str, Any]) -> bytes:
    trainer = state.trainer_state(step, 0, [], state.extra_state(), state.optimizer_settings())
    entries = [[key, list(t.shape), str(t.dtype).removeprefix("torch.")] for key, t in tensors.items()]
    out = io.BytesIO()
    torch.save({"step": step, "tensors": entries, "trainer": trainer, "extras": extras}, out)
    return out.getvalue()


def _receive_header(encoded: bytes | None, source: int) -> Any:
    size = torch.tensor([len(encoded) if encoded is not None else 0], dtype=torch.int64)
    dist.broadcast(size, source)
    length = int(size.item())
    if not 0 < length <= MAX_HEADER_BYTES:
        raise LivePeerError(f"rank {source} announced a state header of {length} bytes (at most {MAX_HEADER_BYTES})")
    data = (torch.frombuffer(bytearray(encoded), dtype=torch.uint8) if encoded is not None
            else torch.empty(length, dtype=torch.uint8))
    dist.broadcast(data, source)
    try:
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever a malformed header raises is one line
        raise LivePeerError(f"rank {source}'s state header does not load: {type(error).__name__}: {error}") from None


def _check_header(header: Any, step: int) -> tuple[list[tuple[str, torch.Size, torch.dtype]], dict, dict]:
    """The header's entries, trainer state and extras, every field checked for its type."""
    if not isinstance(header, dict) or not {"step", "tensors", "trainer", "extras"} <= set(header):
        raise LivePeerError("the live source's state header lacks its fields")
    if header["step"] != step:
        raise LivePeerError(f"the live source sent the state of step {header['step']}, not of step {step}")
    if not isinstance(header["trainer"], dict) or not isinstance(header["extras"], dict):
        raise LivePeerError("the live source's trainer state is not a mapping")
    entries = []
    for entry in header["tensors"] if isinstance(header["tensors"], list) else [None]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(isinstance(d, int) and d >= 0 for d in entry[1])
                and isinstance(entry[2], str)):
            raise LivePeerError(f"the live source's tensor entry {entry!r} is not [key, shape, dtype]")
        dtype = getattr(torch, entry[2], None)
        if not isinstance(dtype, torch.dtype):
            raise LivePeerError(f"the live source's tensor {entry[0]} has no dtype {entry[2]!r}")
        entries.append((entry[0], torch.Size(entry[1]), dtype))
    return entries, header["trainer"], header["extras"]


def _check_fits(state: TrainingState, entries: list, trainer: dict, source: int) -> None:
    """The source's model and optimizer are this run's: same keys, shapes and dtypes, same groups."""
    name = f"of the live peer rank {source}"
    saved = {key: (shape, dtype) for key, shape, dtype in entries}
    if len(saved) != len(entries):
        seen: set[str] = set()
        twice = next(key for key, _, _ in entries if key in seen or seen.add(key))
        raise LivePeerError(f"the live peer rank {source} names {twice!r} more than once in its state header")
    live = state.layout.tensors()
    _check_optimizer_tensors(state.model, live, saved, source)
    live_state.check_shapes(name, live, saved, live_state.MODEL_PREFIX)
    for key, (shape, dtype) in saved.items():
        if key.startswith(live_state.MODEL_PREFIX) and live[key].dtype != dtype:
            raise CheckpointMismatchError(f"the state {name} has {key} as {dtype}, this run as {live[key].dtype}")
        if not key.startswith((live_state.MODEL_PREFIX, live_state.OPTIM_PREFIX)):
            raise LivePeerError(f"the live peer rank {source} sent {key!r}, which is neither model nor optimizer state")
    for field in ("optimizer", "sampler"):
        if not isinstance(trainer.get(field), dict):
            raise LivePeerError(f"the trainer state of the live peer rank {source} has no {field}")
    live_state.check_groups(name, state.optimizer, state.model, trainer["optimizer"])


def _check_optimizer_tensors(
    model: torch.nn.Module, live: dict[str, torch.Tensor], saved: dict[str, tuple[torch.Size, torch.dtype]], source: int,
) -> None:
    """Every optimizer tensor the source names fits what it will be loaded into (the module
    docstring's rule): `LivePeerError` naming the first that does not, before any is allocated."""
    params = dict(model.named_parameters())
    held = {key[len(live_state.OPTIM_PREFIX):].rsplit("/", 1)[0] for key in live
            if key.startswith(live_state.OPTIM_PREFIX)}
    sent: dict[str, int] = {}
    for key, (shape, dtype) in saved.items():
        if not key.startswith(live_state.OPTIM_PREFIX):
            continue
        short = key[len(live_state.OPTIM_PREFIX):]
        param = params.get(short.rsplit("/", 1)[0]) if "/" in short else None
        if param is None:
            raise LivePeerError(f"the live peer rank {source} sent optimizer state {short!r}, for a parameter "
                                "this model lacks")
        param_name = short.rsplit("/", 1)[0]
        sent[param_name] = sent.get(param_name, 0) + 1
        if param_name in held:
            want = (live[key].shape, live[key].dtype) if key in live else None
            if want != (shape, dtype):
                here = "none" if want is None else f"{list(want[0])} {want[1]}"
                raise LivePeerError(f"the live peer rank {source} sent optimizer state {short} as {list(shape)} "
                                    f"{dtype}; this optimizer holds {here}")
        elif sent[param_name] > MAX_STATES_PER_PARAMETER:
            raise LivePeerError(f"the live peer rank {source} sent more than {MAX_STATES_PER_PARAMETER} tensors of "
                                f"optimizer state for {param_name}")
        elif shape != torch.Size([]) and (shape != param.shape or dtype not in (param.dtype, torch.float32)):
            raise LivePeerError(f"the live peer rank {source} sent optimizer state {short} as {list(shape)} {dtype}; "
                                f"its parameter is {list(param.shape)} {param.dtype}")


def _apply(
    ctx: WorkerContext, state: TrainingState, step: int, received: dict[str, torch.Tensor], trainer: dict,
    *, replacement: bool,
) -> None:
    """Everything received and checked: only now does live state change (extra objects first: their
    own code may refuse the state, and then nothing else has changed)."""
    state.apply_extra(step, trainer)
    live = state.layout.tensors()
    with torch.no_grad():
        for key, tensor in received.items():
            if key.startswith(live_state.MODEL_PREFIX):
                live[key].copy_(tensor)
    optimizer_tensors = {k: v for k, v in received.items() if k.startswith(live_state.OPTIM_PREFIX)}
    state.optimizer.load_state_dict(
        live_state.optimizer_state_dict(state.model, state.optimizer, optimizer_tensors, trainer["optimizer"])
    )
    live_state.set_module_extra_state(state.model, trainer.get("module_extra", {}))
    kept = None if replacement else get_rng_state(ctx.device)
    state.apply_trainer(ctx, step, trainer)
    if kept is not None:
        set_rng_state(kept, ctx.device)
