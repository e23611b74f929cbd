"""What the ranks of a job agree on, in one place: small typed collectives on a host-side group.

    if not agreement.all_ok(ctx, wrote_my_part, group):     # every rank, same answer
        ...
    decision = agreement.from_main(ctx, decision if ctx.is_main else None, Decision)

Invariants:
- Every function is a collective: every rank calls it at the same point, with
  the same group (default: `runtime.control_group()`, gloo in every job, so
  none of this waits on a GPU). "Rank 0" is the group's rank 0, which is the
  worker's rank 0 in every group the runtime makes; a group need not be
  registered with torch.distributed (a test runs ranks as threads, each with
  a gloo group of its own on one in-process store).
- Values cross as tensors, or as `Message`s: dataclasses of plain values
  (str, int, float, bool, None, lists, dicts, tensors) written with torch.save
  and read with `torch.load(weights_only=True)`. Nothing a peer sends is
  unpickled as code, and a message is rebuilt only from the fields its class
  declares (`Message.from_plain`), so a message of the wrong shape is an error,
  not a silently wrong value.
- Alone (no process group), each returns this process's own answer.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elastic._worker.runtime.context import WorkerContext, control_group

M = TypeVar("M", bound="Message")
DEFAULT_GROUP: Any = object()
"""A function's `group` when none is given: `runtime.control_group()`, looked up at the call."""
_UNSET = DEFAULT_GROUP


class Message:
    """A dataclass that crosses ranks as a dict of its fields (plain values and tensors).

    Subclasses with fields that are themselves messages override `to_plain` / `from_plain`."""

    def to_plain(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_plain(cls: type[M], raw: Any) -> M:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        if not isinstance(raw, dict) or set(raw) != names:
            raise ValueError(f"a {cls.__name__} from another rank has fields {sorted(raw) if isinstance(raw, dict) else raw!r}")
        return cls(**raw)


def _group(group: dist.ProcessGroup | None | Any) -> dist.ProcessGroup | None:
    return control_group() if group is _UNSET else group


def all_ok(ctx: WorkerContext, ok: bool, group: Any = _UNSET) -> bool:
    """Whether `ok` holds on every rank."""
    if not ctx.distributed:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=_group(group))
    return bool(flag.item())


def any_set(ctx: WorkerContext, *flags: bool, group: Any = _UNSET) -> tuple[bool, ...]:
    """For each flag, whether any rank set it (one collective for all of them)."""
    if not ctx.distributed:
        return tuple(flags)
    votes = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=_group(group))
    return tuple(bool(v) for v in votes.tolist())


class PendingMax:
    """An element-wise MAX of small ints over the ranks, started and not yet read (`start_max`)."""

    def __init__(self, values: torch.Tensor, work: Any) -> None:
        self._values, self._work = values, work

    def result(self) -> list[int]:
        """Waits for the collective (a peer that died raises, as a blocking one would)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return [int(v) for v in self._values.tolist()]


def start_max(ctx: WorkerContext, values: list[int], group: Any = _UNSET) -> PendingMax:
    """Start the element-wise MAX of `values` over the ranks and return at once; `result()` reads it.

    Still a collective: every rank starts it at the same point of the sequence of
    collectives on the group, and reads it before it starts the next one it depends on.
    """
    tensor = torch.tensor(values, dtype=torch.int64)
    if not ctx.distributed:
        return PendingMax(tensor, None)
    return PendingMax(tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_group(group), async_op=True))


def main_flag(ctx: WorkerContext, flag: bool, group: Any = _UNSET) -> bool:
    """Rank 0's `flag`, on every rank."""
    if not ctx.distributed:
        return flag
    tensor = torch.tensor([int(flag)], dtype=torch.int32)
    dist.broadcast(tensor, group_src=0, group=_group(group))
    return bool(tensor.item())


def max_int(ctx: WorkerContext, value: int, group: Any = _UNSET) -> int:
    """The largest `value` of any rank."""
    return _reduce_ints(ctx, [value], dist.ReduceOp.MAX, group)[0]


def sum_ints(ctx: WorkerContext, values: list[int], group: Any = _UNSET) -> list[int]:
    """Element-wise sums of `values` over the ranks."""
    return _reduce_ints(ctx, values, dist.ReduceOp.SUM, group)


def _reduce_ints(ctx: WorkerContext, values: list[int], op: Any, group: Any) -> list[int]:
    if not ctx.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=op, group=_group(group))
    return [int(v) for v in tensor.tolist()]


def from_main(ctx: WorkerContext, message: M | None, kind: type[M], group: Any = _UNSET) -> M | None:
    """Rank 0's `message` (or None), on every rank; the other ranks pass None."""
    if not ctx.distributed:
        return message
    payload = _encode(message) if ctx.is_main else b""
    return _decode(_broadcast_bytes(payload, _group(group)), kind)


def gather_to_main(ctx: WorkerContext, message: M, kind: type[M], group: Any = _UNSET) -> list[M] | None:
    """Every rank's `message`, by rank, on rank 0; None elsewhere. A rank other than 0 sends one row as
    long as the longest message (its length first) and receives 8 bytes: O(1) a rank, O(N) at rank 0."""
    if not ctx.distributed:
        return [message]
    gathered = _gather_bytes(ctx, _encode(message), _group(group), to_all=False)
    return None if gathered is None else [_required(_decode(data, kind), rank) for rank, data in enumerate(gathered)]


def scatter_from_main(ctx: WorkerContext, messages: list[M] | None, kind: type[M], group: Any = _UNSET) -> M | None:
    """Rank 0's `messages[r]` on rank r (rank 0 passes one per rank, the others None): each rank receives
    one row as long as the longest message, O(1) a rank where a broadcast of all would be O(N)."""
    if not ctx.distributed:
        return messages[0] if messages else None
    group = _group(group)
    payloads = [_encode(m) for m in messages] if ctx.is_main and messages is not None else []
    if ctx.is_main and len(payloads) != ctx.world_size:
        raise ValueError(f"rank 0 scatters {len(payloads)} messages to {ctx.world_size} ranks")
    length = torch.tensor([max((len(p) for p in payloads), default=0)], dtype=torch.int64)
    dist.broadcast(length, group_src=0, group=group)
    row = torch.empty(_LENGTH + int(length.item()), dtype=torch.uint8)
    rows = [_row(p, int(length.item())) for p in payloads] if ctx.is_main else None
    dist.scatter(row, rows, group_src=0, group=group)
    return _decode(_unrow(row), kind)


def all_gather(ctx: WorkerContext, message: M, kind: type[M], group: Any = _UNSET) -> list[M]:
    """Every rank's `message`, by rank, on every rank."""
    if not ctx.distributed:
        return [message]
    gathered = _gather_bytes(ctx, _encode(message), _group(group), to_all=True)
    assert gathered is not None
    return [_required(_decode(data, kind), rank) for rank, data in enumerate(gathered)]


def all_gather_rows(ctx: WorkerContext, row: torch.Tensor, group: Any = _UNSET) -> list[torch.Tensor]:
    """Every rank's `row` (a 1-D tensor of the same length and dtype on every rank), by rank: one
    collective, for what is small, fixed in size and read often (a replica check's digests)."""
    if not ctx.distributed:
        return [row]
    rows = [torch.empty_like(row) for _ in range(ctx.world_size)]
    dist.all_gather(rows, row, group=_group(group))
    return rows


@dataclass(frozen=True)
class Text(Message):
    """One line of text (a reason, an error) crossing ranks."""

    text: str


def main_text(ctx: WorkerContext, text: str | None, group: Any = _UNSET) -> str | None:
    """Rank 0's `text` on every rank (two collectives only when there is one)."""
    if not main_flag(ctx, text is not None, group):
        return None
    shared = from_main(ctx, Text(text) if ctx.is_main and text is not None else None, Text, group)
    return shared.text if shared is not None else None


def _required(message: M | None, rank: int) -> M:
    if message is None:
        raise ValueError(f"rank {rank} sent no message")
    return message


# -- the wire ---------------------------------------------------------------------------


def _encode(message: Message | None) -> bytes:
    buffer = io.BytesIO()
    torch.save(None if message is None else message.to_plain(), buffer)
    return buffer.getvalue()


def _decode(data: bytes, kind: type[M]) -> M | None:
    plain = torch.load(io.BytesIO(data), weights_only=True)
    return None if plain is None else kind.from_plain(plain)


def _as_tensor(data: bytes, length: int) -> torch.Tensor:
    tensor = torch.zeros(length, dtype=torch.uint8)
    if data:
        tensor[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return tensor


def _broadcast_bytes(data: bytes, group: dist.ProcessGroup | None) -> bytes:
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, group_src=0, group=group)
    buffer = _as_tensor(data, int(size.item()))
    dist.broadcast(buffer, group_src=0, group=group)
    return buffer.numpy().tobytes()


_LENGTH = 8
"""Bytes of the length that heads a row of `_row` (little-endian)."""


def _row(data: bytes, length: int) -> torch.Tensor:
    """`data` headed by its length, padded to `length` bytes of data."""
    return _as_tensor(len(data).to_bytes(_LENGTH, "little") + data, _LENGTH + length)


def _unrow(row: torch.Tensor) -> bytes:
    raw = row.numpy().tobytes()
    length = int.from_bytes(raw[:_LENGTH], "little")
    if length > len(raw) - _LENGTH:
        raise ValueError(f"a row from another rank says {length} bytes and holds {len(raw) - _LENGTH}")
    return raw[_LENGTH : _LENGTH + length]


def _gather_bytes(ctx: WorkerContext, data: bytes, group: dist.ProcessGroup | None, *, to_all: bool) -> list[bytes] | None:
    if not to_all:  # the longest length (an all-reduce), then rows that carry their own length
        longest = torch.tensor([len(data)], dtype=torch.int64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
        row = _row(data, int(longest.item()))
        out = [torch.empty_like(row) for _ in range(ctx.world_size)] if ctx.is_main else None
        dist.gather(row, out, group_dst=0, group=group)
        return None if out is None else [_unrow(t) for t in out]
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    lengths = [int(s.item()) for s in sizes]
    padded = _as_tensor(data, max(lengths))
    out = [torch.empty_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(out, padded, group=group)
    return [t[:n].numpy().tobytes() for t, n in zip(out, lengths)]
