"""The memory tier, worker side: every step's state into node shared memory, and a copy on a peer node.

Under `torchrevive-run` each node runs a snapshot keeper (`elastic.launcher.keeper`),
a part of the launcher that outlives the workers. It owns a directory in shared
memory (/dev/shm) and an HTTP endpoint for its peers, and tells the workers
where both are (`KeeperAddress`, from the environment). Each worker:

- writes its part of the state (its share of what a durable checkpoint holds,
  see parts.py) into that directory at every `every`-th step, the loop blocking
  only while the state is copied (the copy of parameters and optimizer state
  runs off the loop until the next optimizer step, as for checkpoints);
- sends the part to the keeper of one peer node (node i -> node i+1, a ring),
  on the same background thread, so losing a whole node still leaves a copy;
- at restore, reports what its node holds (`inventory`), and reads the parts
  its node lacks from the keepers that hold them, only the rows it needs
  (`gather_files`, `PartFiles`).

Invariants:
- At most one snapshot is in flight per worker: the next one waits for the
  previous one's copy, checksums, header and replica, so every part a header
  names is whole and the replica is at most one snapshot behind.
- A snapshot's data file is allocated in full (fallocate) before it is mapped:
  a full /dev/shm is an error at allocation (snapshots turn off with a
  warning), never a SIGBUS in the middle of a copy.
- Nothing here is on the restore's trust path: every chunk read is checked
  against its crc32c (sharded.read_rows), whatever its source.
"""

from __future__ import annotations

import http.client
import logging
import mmap
import os
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic.checkpoint import parts, sharded
from elastic.checkpoint.parts import PartHeader
from elastic.checkpoint.snapshot import DeferredCopy
from elastic.checkpoint.writer import BackgroundWriter
from elastic.runtime import WorkerContext, control_group

logger = logging.getLogger(__name__)

ROOT_ENV = "TORCHREVIVE_SNAPSHOT_ROOT"
URL_ENV = "TORCHREVIVE_SNAPSHOT_URL"
NODE_ENV = "TORCHREVIVE_SNAPSHOT_NODE"
LOCAL, REPLICA, PROGRESS = "local", "replica", "progress"
PUSH_TIMEOUT = 30.0
PUSH_PAUSE = 30.0
"""Seconds without copies to the peer after one failed (a slow peer must not slow every step)."""


@dataclass(frozen=True)
class KeeperAddress:
    """Where this node's keeper keeps snapshots (`root`) and serves them to peers (`url`)."""

    root: Path
    url: str
    node: str

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> KeeperAddress | None:
        env = os.environ if environ is None else environ
        root, url, node = env.get(ROOT_ENV), env.get(URL_ENV), env.get(NODE_ENV)
        if not (root and url and node) or not os.path.isdir(root):
            return None
        return cls(Path(root), url, node)

    def environ(self) -> dict[str, str]:
        return {ROOT_ENV: str(self.root), URL_ENV: self.url, NODE_ENV: self.node}


@dataclass(frozen=True)
class _Entry:
    key: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    global_size: tuple[int, ...]
    global_offset: tuple[int, ...]


def _local_and_global(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local data, global size, global offset of the local data) of a tensor or DTensor shard."""
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), tuple(tensor.shape), tuple(int(o) for o in offset)
    return tensor, tuple(tensor.shape), (0,) * tensor.dim()


class _Slot:
    """One data file in shared memory, mapped, with a tensor view per key (layout fixed at creation)."""

    def __init__(self, path: Path, entries: list[_Entry], size: int) -> None:
        self.path = path
        self.entries = entries
        self.size = size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            if size:
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS mid-copy
        finally:
            os.close(fd)
        self.data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self.views = {
            e.key: self.data[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries
        }
        self.signature = layout_signature(entries)

    def get(self, path: str, like: torch.Tensor) -> torch.Tensor:
        """The buffer for `path` ("later/<key>", as `snapshot.plan_copies` names it)."""
        return self.views[path.split("/", 1)[1]]


def layout_signature(entries: list[_Entry]) -> tuple[Any, ...]:
    """What a slot's mapping depends on: a slot is reused while this stays the same."""
    return tuple((e.key, e.dtype, e.shape) for e in entries)


def plan_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[_Entry], int]:
    entries: list[_Entry] = []
    offset = 0
    for key in sorted(tensors):
        local, global_size, global_offset = _local_and_global(tensors[key])
        nbytes = local.numel() * local.element_size()
        entries.append(_Entry(key, offset, nbytes, local.dtype, tuple(local.shape), global_size, global_offset))
        offset += -(-nbytes // parts.ALIGN) * parts.ALIGN
    return entries, offset


class MemorySnapshots:
    """This worker's snapshots: write them, replicate them, and find them again after a failure."""

    def __init__(
        self,
        ctx: WorkerContext,
        keeper: KeeperAddress,
        *,
        every: int,
        ckpt_dir: str,
        keep: int,
        fault: Callable[[str, int], None] = lambda point, step: None,
    ) -> None:
        self._ctx = ctx
        self.keeper = keeper
        self.every = every
        self._ckpt_dir = ckpt_dir
        self._keep = keep
        self._fault = fault
        self.writer_id = parts.new_writer_id()
        self._local = keeper.root / LOCAL
        self._local.mkdir(parents=True, exist_ok=True)
        self._slots: list[_Slot | None] = [None, None]
        self._next_slot = 0
        self._writer = BackgroundWriter(name="snapshot-writer", drain_timeout=PUSH_TIMEOUT)
        self._peer: str | None = None
        self._push_warned = False
        self.disabled: str | None = None
        """Why snapshots stopped (shared memory full, say); None while they run."""
        self.history: list[dict[str, float]] = []
        """Per snapshot: step, seconds (copy to replica done)."""
        self.blocking_seconds: list[float] = []
        """Per snapshot: seconds the loop was blocked taking it (the optimizer step's wait not included)."""
        self.step_wait_seconds: list[float] = []
        """Per snapshot: seconds the next optimizer step waited for it to be written and replicated."""
        self.generation = ""
        """The restore this worker resumed from (shared by every rank): a plan takes parts of one."""
        self._push_paused_until = 0.0
        self._progress = self._open_progress()

    # -- progress ------------------------------------------------------------------

    def _open_progress(self) -> mmap.mmap | None:
        directory = self.keeper.root / PROGRESS
        try:
            directory.mkdir(exist_ok=True)
            path = directory / f"rank_{self._ctx.rank:05d}"
            with open(path, "a+b") as f:
                f.truncate(8)
                return mmap.mmap(f.fileno(), 8)
        except OSError:
            return None

    def note_step(self, step: int) -> None:
        """The newest step this rank finished (read back after a failure: steps redone)."""
        if self._progress is not None:
            struct.pack_into("<q", self._progress, 0, step)

    def reset_progress(self, step: int) -> None:
        """After a restore: this rank's progress is `step`, and the node forgets ranks it no longer
        runs (their notes would count at the next failure). Local rank 0 does the forgetting."""
        self.note_step(step)
        if self._ctx.local_rank != 0:
            return
        first = self._ctx.rank - self._ctx.local_rank
        mine = {f"rank_{r:05d}" for r in range(first, first + self._ctx.local_world_size)}
        for path in (self.keeper.root / PROGRESS).glob("rank_*"):
            if path.name not in mine:
                path.unlink(missing_ok=True)

    def last_progress(self) -> int | None:
        """The newest step any worker of this node noted (before this restart)."""
        newest = None
        for path in (self.keeper.root / PROGRESS).glob("rank_*"):
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            if len(raw) == 8:
                step = struct.unpack("<q", raw)[0]
                newest = step if newest is None else max(newest, step)
        return newest

    # -- peers ---------------------------------------------------------------------

    def connect(self) -> None:
        """A collective: learn every node's keeper and pick this node's peer (the next node, in a ring)."""
        mine = (self.keeper.node, self.keeper.url)
        if not self._ctx.distributed:
            return
        everyone: list[Any] = [None] * self._ctx.world_size
        dist.all_gather_object(everyone, mine, group=control_group())
        nodes: list[tuple[str, str]] = []
        for node in everyone:
            if tuple(node) not in nodes:
                nodes.append(tuple(node))
        if len(nodes) < 2:
            self._peer = None
            if self._ctx.is_main:
                logger.info("snapshots stay on this node: the job runs on one node, so there is no peer to copy them to")
            return
        index = nodes.index(mine)
        self._peer = nodes[(index + 1) % len(nodes)][1]

    # -- writing ---------------------------------------------------------------------

    def due(self, step: int) -> bool:
        return self.disabled is None and self.every > 0 and step % self.every == 0

    def wait_previous(self) -> None:
        """Loop thread: the previous snapshot is written and replicated (at most one in flight)."""
        try:
            self._writer.wait()
        except Exception as exc:  # noqa: BLE001 - a snapshot bug must not stop training: say it, turn them off
            self._disable(f"a snapshot failed ({type(exc).__name__}: {exc})")

    def submit(
        self,
        step: int,
        trainer: dict[str, Any],
        buffers: dict[str, torch.Tensor],
        build: Callable[[], dict[str, torch.Tensor]],
        deferred: DeferredCopy,
    ) -> None:
        """Write the snapshot of `step` on the snapshot thread: `build()` gives this rank's live
        share, whose parameters and optimizer state `deferred` copies there; its buffers come
        from `buffers` (copies already, of at least the share's buffers), as does `trainer`."""
        self._writer.submit(lambda: self._write(step, trainer, buffers, build, deferred))

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            logger.warning("in-memory snapshots are off from now on: %s; checkpoints go to disk only", why)

    def _slot_for(self, tensors: dict[str, torch.Tensor]) -> tuple[int, _Slot]:
        """The slot to write next and its index, its header gone (so no reader trusts it while it changes)."""
        index = self._next_slot
        self._next_slot = 1 - index
        entries, size = plan_layout(tensors)
        signature = layout_signature(entries)
        stem = parts.part_stem(self._ctx.rank, self.writer_id, index)
        (self._local / (stem + parts.HEADER_SUFFIX)).unlink(missing_ok=True)
        slot = self._slots[index]
        if slot is None or slot.signature != signature:
            self._slots[index] = None  # unmap the old layout first
            slot = _Slot(self._local / (stem + parts.DATA_SUFFIX), entries, size)
            self._slots[index] = slot
        return index, slot

    def _write(
        self,
        step: int,
        trainer: dict[str, Any],
        buffers: dict[str, torch.Tensor],
        build: Callable[[], dict[str, torch.Tensor]],
        deferred: DeferredCopy,
    ) -> None:
        started = time.perf_counter()
        if self._ctx.device.type == "cuda":
            torch.cuda.set_device(self._ctx.device)
        try:
            share = build()
            live = {k: v for k, v in share.items() if k not in buffers}
            tensors = {k: buffers.get(k, v) for k, v in share.items()}
            index, slot = self._slot_for(tensors)
        except Exception as exc:  # noqa: BLE001 - full /dev/shm (OSError), a failed mapping: degrade, never hang
            deferred.run(lambda: {}, None)  # release the optimizer step
            what = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            self._disable(f"cannot allocate the snapshot in {self.keeper.root} ({what})")
            return
        deferred.run(lambda: live, slot)
        for key in tensors.keys() - live.keys():
            slot.views[key].copy_(sharded.local_part(buffers[key]))
        self._fault("during_snapshot", step)
        data = memoryview(slot.data.numpy()) if slot.size else memoryview(b"")
        chunks, shapes = [], {}
        for entry in slot.entries:
            piece = data[entry.offset : entry.offset + entry.nbytes]
            stored = sharded.StoredChunk(
                parts.part_stem(self._ctx.rank, self.writer_id, index) + parts.DATA_SUFFIX,
                entry.offset, entry.nbytes, str(entry.dtype), entry.shape,
                tuple(sharded.block_checksums(piece, sharded.BLOCK)), sharded.BLOCK,
            )
            chunks.append({"fqn": entry.key, "at": list(entry.global_offset), **stored.to_json()})
            shapes[entry.key] = {"dtype": str(entry.dtype), "size": list(entry.global_size)}
        blob, blob_crc = parts.encode_trainer(trainer)
        header = PartHeader(
            run_id=self._ctx.run_id, step=step, rank=self._ctx.rank, world_size=self._ctx.world_size,
            writer=self.writer_id, slot=index, data_bytes=slot.size, chunks=chunks, tensors=shapes,
            trainer=blob, trainer_crc32c=blob_crc, ckpt_dir=self._ckpt_dir, keep=self._keep, created=time.time(),
            extra={"generation": self.generation},
        )
        parts.write_header(self._local, header)
        if self._peer is not None and time.monotonic() >= self._push_paused_until:
            self._push(header, data)
        self.history.append({"step": step, "seconds": time.perf_counter() - started})

    def _push(self, header: PartHeader, data: memoryview) -> None:
        """Send the part to the peer's keeper; a failure is one warning (the local copy stands)."""
        head = header.to_json()
        url = urlsplit(self._peer)
        try:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=PUSH_TIMEOUT)
            try:
                conn.putrequest("PUT", f"/replica/{header.stem}")
                conn.putheader("Content-Length", str(len(head) + len(data)))
                conn.putheader("X-Header-Bytes", str(len(head)))
                conn.endheaders()
                conn.send(head)
                conn.send(data)
                response = conn.getresponse()
                response.read()
                if response.status != 204:
                    raise OSError(f"HTTP {response.status} {response.reason}")
            finally:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            # A peer that does not answer must not hold every step: no copies for a while.
            self._push_paused_until = time.monotonic() + PUSH_PAUSE
            if not self._push_warned:
                self._push_warned = True
                logger.warning("cannot copy the snapshot to the peer node's keeper at %s (%s); "
                               "a loss of this node would restore from disk", self._peer, exc)
            return
        self._push_warned = False

    # -- finding them again ------------------------------------------------------------

    def inventory(self) -> dict[str, Any]:
        """What this node holds: its keeper, the newest step its workers finished, and every part."""
        held = []
        for where in (LOCAL, REPLICA):
            for header in parts.read_headers(self.keeper.root / where):
                if header.run_id == self._ctx.run_id:
                    held.append((where, header))
        return {"node": self.keeper.node, "url": self.keeper.url, "progress": self.last_progress(), "parts": held}

    def gather_files(
        self, locations: dict[int, list[tuple[str, str, str, str]]], tag: str, *, fetch_deadline: float | None = None
    ) -> PartFiles:
        """The parts of a restore, as this rank reads them: a directory where `shard_file(r)` is
        old rank r's part data when this node holds it (a symlink to it), and the keepers to
        ask for the rows of the others (`PartFiles`, read only where this rank's plan reads).

        `locations`: old rank -> [(node, keeper url, where, stem)], this node's first when it has one.
        `fetch_deadline` (time.monotonic): no request to another keeper starts or waits past it.
        """
        directory = self.keeper.root / f"restore-{tag}-{self._ctx.rank:05d}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        remote: dict[str, list[str]] = {}
        for old_rank, places in locations.items():
            here = [p for p in places if p[0] == self.keeper.node]
            if here:
                _, _, where, stem = here[0]
                os.symlink(self.keeper.root / where / (stem + parts.DATA_SUFFIX), directory / sharded.shard_file(old_rank))
            else:
                remote[sharded.shard_file(old_rank)] = [
                    f"{url}/part/{where}/{stem}{parts.DATA_SUFFIX}" for _, url, where, stem in places
                ]
        return PartFiles(directory, remote, deadline=fetch_deadline)

    def close(self, timeout: float = PUSH_TIMEOUT) -> None:
        try:
            self._writer.close(timeout=min(timeout, PUSH_TIMEOUT))
        except Exception as exc:  # noqa: BLE001 - closing: a late snapshot failure is only logged
            logger.debug("snapshot writer: %s", exc)
        if self._progress is not None:
            self._progress.close()
            self._progress = None


READ_GAP = 2**20
READ_MAX = 2**26
"""Spans of a remote part at most READ_GAP apart are fetched in one request of up to READ_MAX
bytes (a larger chunk in one of its own): few round trips, bounded memory."""


class PartFetchError(OSError):
    """No keeper sent a part's bytes (in time): the restore falls back to disk."""


class PartFiles:
    """A restore's parts as one rank reads them (a `sharded.ChunkSource`): this node's through
    maps, another node's by HTTP range requests to the keepers holding them, for the spans the
    rank's plan reads only (nearby spans joined, see `READ_GAP`), one request at a time.

    Nothing fetched is trusted: the reader checks every block's crc32c as for a file. A keeper
    that fails is asked again only after the others holding the part; when all fail, or
    `deadline` (time.monotonic) has passed, a `PartFetchError`."""

    def __init__(self, directory: Path, remote: dict[str, list[str]], *, deadline: float | None = None) -> None:
        self.directory = directory
        self.remote = remote
        """file name -> URLs of the keepers that hold it, in the order to try them."""
        self.deadline = deadline
        self._failed: set[str] = set()
        # Maps only in memory: on a disk (TORCHREVIVE_SNAPSHOT_BASE may name one) a read
        # error through a map would be a SIGBUS, not an OSError.
        self._maps = sharded.MappedFiles(directory) if in_memory(directory) else None
        self._requests: dict[str, list[tuple[int, int]]] = {}
        self._held: tuple[str, int, int, bytearray] | None = None
        self.bytes_fetched = 0

    def expect(self, spans: list[tuple[str, int, int]]) -> None:
        self._requests = {}
        for file, start, stop in sorted(s for s in spans if s[0] in self.remote):
            joined = self._requests.setdefault(file, [])
            if joined and start - joined[-1][1] <= READ_GAP and stop - joined[-1][0] <= READ_MAX:
                joined[-1] = (joined[-1][0], max(joined[-1][1], stop))
            else:
                joined.append((start, stop))

    def view(self, file: str, start: int, stop: int) -> memoryview | bytearray | None:
        if file not in self.remote:
            return self._maps.view(file, start, stop) if self._maps is not None else _read_span(self.directory / file, start, stop)
        held = self._held
        if held is None or held[0] != file or not held[1] <= start <= stop <= held[2]:
            lo, hi = next(((a, b) for a, b in self._requests.get(file, []) if a <= start and stop <= b), (start, stop))
            data = self._fetch(file, lo, hi)
            if len(data) < hi - lo:  # the part is shorter than its header says
                return None
            held = self._held = (file, lo, hi, data)
        return memoryview(held[3])[start - held[1] : stop - held[1]]

    def _fetch(self, file: str, start: int, stop: int) -> bytearray:
        errors = []
        for url in sorted(self.remote[file], key=lambda u: u in self._failed):  # stable: failed ones last
            timeout = PUSH_TIMEOUT
            if self.deadline is not None:
                timeout = min(timeout, self.deadline - time.monotonic())
                if timeout <= 0:
                    errors.append("the restore's time for fetching parts is spent")
                    break
            try:
                data = _get_range(url, start, stop, timeout)
                self.bytes_fetched += len(data)
                return data
            except (OSError, ValueError, http.client.HTTPException) as exc:
                self._failed.add(url)
                errors.append(f"{urlsplit(url).netloc}: {exc}")
        raise PartFetchError(f"no keeper could send {file} ({'; '.join(errors)})")

    def close(self) -> None:
        self._held = None
        if self._maps is not None:
            self._maps.close()


def in_memory(path: Path) -> bool:
    """Whether `path` lies on a tmpfs (the longest mount point above it, from /proc/self/mounts)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    resolved, best, kind = str(path.resolve()), "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (resolved == point or resolved.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind == "tmpfs"


def _read_span(path: Path, start: int, stop: int) -> bytearray | None:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(stop - start)
    return bytearray(data) if len(data) == stop - start else None


def _get_range(url: str, start: int, stop: int, timeout: float = PUSH_TIMEOUT) -> bytearray:
    """Bytes [start, stop) of the part at `url` (fewer if it is shorter), by a range request."""
    parsed = urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.request("GET", parsed.path, headers={"Range": f"bytes={start}-{stop - 1}"})
        response = conn.getresponse()
        if response.status == 416:  # starts past the end: a short part
            response.read()
            return bytearray()
        if response.status != 206:
            response.read()
            raise OSError(f"HTTP {response.status} {response.reason} for {parsed.path}")
        declared = (response.headers.get("Content-Length") or "").strip()
        length = int(declared) if declared.isascii() and declared.isdigit() else -1
        if not 0 <= length <= stop - start:
            raise OSError(f"{parsed.path}: {declared or 'no'} bytes for a range of {stop - start}")
        data = bytearray(length)
        view, got = memoryview(data), 0
        while got < len(data):
            n = response.readinto(view[got:])
            if not n:
                raise OSError(f"{parsed.path} ended after {got} of {len(data)} bytes")
            got += n
        return data
    finally:
        conn.close()
