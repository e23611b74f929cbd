"""What the control-plane simulator (scale.py) counts, and the stand-ins it counts them through.

- `Tally`: one simulated rank's (or node's) store operations and bytes, thread-safe.
- `CountingStore`: a `torch.distributed.Store` that forwards every call to a real store client (a
  TCPStore connection, an `EtcdStore`) and adds it to a `Tally`. It is a Store, so torch's own code
  (`PrefixStore`, the rendezvous handlers) runs on it unchanged; nothing of torch is patched.
- `count_etcd`: an `EtcdClient`'s gRPC stubs wrapped so that each request (a range, a transaction, a
  lease keep-alive) is one operation of the tally, with the bytes of its request and its reply.
- `SimWorld` / `SimGroup`: a process group of threads (a Python `ProcessGroup` torch's collectives
  accept as `group=`), for the paths that agree through collectives (the memory restore, the vote's
  slots, the replica check): the real code calls `dist.all_gather(..., group=...)` as in a job, and the
  group counts the bytes each rank would move under the usual algorithms (ring all-reduce and
  all-gather, a broadcast's and a scatter's one copy per receiver, a gather's root receiving every row).

Bytes are the keys and values a call carries (no framing): what grows with the job is what matters.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future


HEARTBEAT_THREADS = ("RendezvousKeepAliveTimer", "etcd-lease-keepalive", "etcd-rdzv-presence")
"""Threads whose operations are heartbeats: torch's keep-alive timer, the etcd lease's and presence's."""


@dataclass
class Tally:
    """One rank's counts: operations by kind and bytes, on stores (`ops`) and in collectives (`collectives`);
    the operations made on a heartbeat thread are also counted apart."""

    ops: Counter = field(default_factory=Counter)
    bytes: int = 0
    collectives: int = 0
    collective_bytes: int = 0
    heartbeat_ops: int = 0
    heartbeat_bytes: int = 0
    won: int = 0
    """Compare-and-sets of a large value (a rendezvous state) that won."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, nbytes: int) -> None:
        beat = threading.current_thread().name.startswith(HEARTBEAT_THREADS)
        with self._lock:
            self.ops[kind] += 1
            self.bytes += nbytes
            if beat:
                self.heartbeat_ops += 1
                self.heartbeat_bytes += nbytes

    def heartbeat_snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.heartbeat_ops, self.heartbeat_bytes

    def collective(self, nbytes: int) -> None:
        with self._lock:
            self.collectives += 1
            self.collective_bytes += nbytes

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def snapshot(self) -> tuple[int, int]:
        """(store operations, bytes) so far: a phase's cost is the difference of two snapshots."""
        with self._lock:
            return sum(self.ops.values()), self.bytes


def _size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    return 8


class CountingStore(dist.Store):
    """`inner` (a store client) with every call counted in `tally` (see the module docstring)."""

    def __init__(self, inner: Any, tally: Tally) -> None:
        super().__init__()
        self.inner = inner
        self.tally = tally

    def set(self, key: str, value: Any) -> None:
        self.tally.add("set", _size(key) + _size(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self.tally.add("get", _size(key) + _size(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self.tally.add("add", _size(key) + 8)
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        self.tally.add("compare_set", _size(key) + _size(expected) + _size(desired) + _size(value))
        if _size(desired) > 1024 and bytes(value) == (desired.encode() if isinstance(desired, str) else bytes(desired)):
            self.tally.won += 1  # a large value written: a rendezvous state's compare-and-set that won
        return value

    def check(self, keys: list[str]) -> bool:
        self.tally.add("check", _size(keys))
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self.tally.add("multi_get", _size(keys) + _size(values))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.tally.add("multi_set", _size(keys) + _size(values))
        self.inner.multi_set(keys, values)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.tally.add("wait", _size(keys))
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self.tally.add("delete_key", _size(key))
        return self.inner.delete_key(key)

    def append(self, key: str, value: Any) -> None:
        self.tally.add("append", _size(key) + _size(value))
        self.inner.append(key, value)

    def num_keys(self) -> int:
        self.tally.add("num_keys", 8)
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> CountingStore:
        """Another client of the same store, counted in the same tally."""
        return CountingStore(self.inner.clone(), self.tally)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout

    def has_extended_api(self) -> bool:
        return bool(getattr(self.inner, "has_extended_api", lambda: False)())


# -- etcd -------------------------------------------------------------------------------------------


class _CountedStub:
    """A gRPC stub whose calls add to a tally: one operation per request, its bytes and its reply's."""

    def __init__(self, stub: Any, tally: Tally, kind: str) -> None:
        self._stub, self._tally, self._kind = stub, tally, kind

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)
        tally, kind = self._tally, f"{self._kind}.{name}"

        def unary(request: Any, *args: Any, **kwargs: Any) -> Any:
            if not hasattr(request, "ByteSize"):  # a stream of requests (LeaseKeepAlive, Watch)
                return _counted_stream(method(request, *args, **kwargs), tally, kind)
            reply = method(request, *args, **kwargs)
            tally.add(kind, request.ByteSize() + (reply.ByteSize() if hasattr(reply, "ByteSize") else 0))
            return reply

        return unary


class _counted_stream:  # noqa: N801 - an iterator that keeps the stream's cancel()
    def __init__(self, stream: Any, tally: Tally, kind: str) -> None:
        self._stream, self._tally, self._kind = stream, tally, kind

    def __iter__(self) -> _counted_stream:
        return self

    def __next__(self) -> Any:
        reply = next(self._stream)
        self._tally.add(self._kind, reply.ByteSize() + 16)
        return reply

    def cancel(self) -> Any:
        return self._stream.cancel()


def count_etcd(client: Any, tally: Tally) -> Any:
    """`client` (an `EtcdClient`) with its stubs counted in `tally`; returns it."""
    for connection in client._connections:
        if isinstance(connection.kv, _CountedStub):
            continue
        connection.kv = _CountedStub(connection.kv, tally, "kv")
        connection.lease = _CountedStub(connection.lease, tally, "lease")
        connection.watch = _CountedStub(connection.watch, tally, "watch")
    return client


# -- a process group of threads ----------------------------------------------------------------------


class _Done(dist._Work):
    def __init__(self, wait: Callable[[], None], result: Any) -> None:
        super().__init__()
        self._wait, self._result = wait, result
        self._future: Future = Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._future.done():  # once: the world counts each rank's taking of a result
            self._wait()
            self._future.set_result(self._result)
        return True

    def get_future(self) -> Future:
        self.wait()
        return self._future


class SimWorld:
    """The shared side of `SimGroup`s: every rank's input to each collective, by sequence number."""

    def __init__(self, size: int, timeout: float = 600.0) -> None:
        self.size = size
        self.timeout = timeout
        self._lock = threading.Condition()
        self._slots: dict[int, dict[int, Any]] = {}
        self._results: dict[int, Any] = {}
        self._taken: Counter = Counter()
        self.tallies = [Tally() for _ in range(size)]

    def meet(self, seq: int, rank: int, value: Any, combine: Callable[[list[Any]], Any]) -> Callable[[], Any]:
        """Put `value` in collective `seq`; a function that waits for every rank's and returns `combine` of them."""
        with self._lock:
            slot = self._slots.setdefault(seq, {})
            slot[rank] = value
            if len(slot) == self.size:
                self._results[seq] = combine([slot[r] for r in range(self.size)])
                del self._slots[seq]
                self._lock.notify_all()

        def result() -> Any:
            with self._lock:
                if not self._lock.wait_for(lambda: seq in self._results, self.timeout):
                    raise RuntimeError(f"simulated collective {seq}: not every rank came within {self.timeout} s")
                value = self._results[seq]
                self._taken[seq] += 1
                if self._taken[seq] == self.size:
                    del self._results[seq], self._taken[seq]
                return value

        return result

    def groups(self) -> list[SimGroup]:
        return [SimGroup(self, rank) for rank in range(self.size)]


_REDUCE = {"MAX": torch.maximum, "MIN": torch.minimum, "SUM": torch.add}


def _op_name(opts: Any) -> str:
    op = getattr(opts, "reduceOp", None)
    text = str(getattr(op, "op", op)).rsplit(".", 1)[-1].upper()
    return text if text in _REDUCE else "SUM"


class SimGroup(dist.ProcessGroup):
    """One rank's handle on a `SimWorld` (see the module docstring)."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        super().__init__(rank, world.size)
        self.world, self._rank, self._seq = world, rank, 0
        self.tally = world.tallies[rank]

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "sim"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        tensor, n, reduce = tensors[0], self.world.size, _REDUCE[_op_name(opts)]

        def combine(values: list[torch.Tensor]) -> torch.Tensor:
            out = values[0].clone()
            for value in values[1:]:
                out = reduce(out, value)
            return out

        result = self.world.meet(self._next(), self._rank, tensor.clone(), combine)
        size = tensor.numel() * tensor.element_size()
        self.tally.collective(2 * size * (n - 1) // n)  # a ring all-reduce: received by each rank
        return _Done(lambda: tensor.copy_(result()), tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        tensor = inputs[0]
        result = self.world.meet(self._next(), self._rank, tensor.clone(), list)
        self.tally.collective(tensor.numel() * tensor.element_size() * (self.world.size - 1))

        def fill() -> None:
            for out, value in zip(outputs[0], result()):
                out.copy_(value)

        return _Done(fill, outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Done:
        tensor, root = tensors[0], opts.rootRank
        result = self.world.meet(self._next(), self._rank, tensor.clone() if self._rank == root else None,
                                 lambda values: values[root])
        self.tally.collective(0 if self._rank == root else tensor.numel() * tensor.element_size())
        return _Done(lambda: tensor.copy_(result()), tensors)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Done:
        tensor, root = inputs[0], opts.rootRank
        result = self.world.meet(self._next(), self._rank, tensor.clone(), list)
        size = tensor.numel() * tensor.element_size()
        self.tally.collective(size * (self.world.size - 1) if self._rank == root else 0)

        def fill() -> None:
            values = result()
            if self._rank == root:
                for out, value in zip(outputs[0], values):
                    out.copy_(value)

        return _Done(fill, outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> _Done:
        tensor, root = outputs[0], opts.rootRank
        rows = [row.clone() for row in inputs[0]] if self._rank == root else None
        result = self.world.meet(self._next(), self._rank, rows, lambda values: values[root])
        self.tally.collective(0 if self._rank == root else tensor.numel() * tensor.element_size())
        return _Done(lambda: tensor.copy_(result()[self._rank]), outputs)

    def barrier(self, opts: Any = None) -> _Done:
        result = self.world.meet(self._next(), self._rank, None, lambda values: None)
        self.tally.collective(0)
        return _Done(result, [])
