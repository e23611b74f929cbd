"""The snapshot keeper: the launcher's side of the memory tier, on each node.

It lives in the torchrun agent's process (`torchrevive-run`), which outlives
every worker it starts, and:

- owns a directory in shared memory (`/dev/shm/torchrevive-snapshots-<uid>/<node>/`,
  or under `TORCHREVIVE_SNAPSHOT_BASE`; `private_directory`: mode 0700, this
  user's, so no other local user can read or replace the parts or the secret) where this node's workers write their
  snapshot parts (`elastic._worker.checkpoint.memory`), and tells the workers where it
  is through the environment;
- serves those parts to the other nodes' workers, and takes the parts a peer
  node's workers copy to it, over HTTP on the address the agent was given
  (`--local-addr`, or `TORCHREVIVE_SNAPSHOT_HOST`), port chosen by the system;
- when its workers stop (a failure, or a restart for a membership change),
  writes the newest snapshot it holds to the job's `--ckpt-dir` as a normal
  committed checkpoint (`persist`), so a whole-job crash right after a failure
  still loses at most one step;
- removes what is no longer needed: the parts of dead workers once newer ones
  exist, replicas beyond the newest two steps, and (at start) the directories
  of keepers on this host whose agent is gone.

Invariants:
- Persisting goes through a staging directory in `--ckpt-dir` per step, shared
  by every node's keeper: each copies in the parts it holds (its own workers'
  and its peer's replicas), each part checked against its crc32c on the way;
  whichever keeper finds every rank's part there commits it (one wins, by an
  exclusively created file) through the one commit rank 0 uses too
  (storage.commit), which honours the directory's claim: a keeper commits only
  where its job writes. Only steps newer than the newest committed checkpoint
  are written (keeper_directory.py; keeper_bucket.py in a bucket).
- A part's files are never removed while a persist runs, nor while no newer
  snapshot exists (a restore may still read them).
- Its endpoint (keeper_endpoint.py) answers only requests signed with the job's
  secret and serves part files by name only (no paths). A replica is kept only
  when its tag verified, it belongs to this run, to the generation and world size
  this node's workers run (`job.json`, which they write at each restore) and it
  leaves `free_reserve` of the file system free (keeper_receive.py, which rewrites
  each replica slot in place); what it receives is data and JSON, and nothing it
  serves or stores is ever executed.
- No failure of one persist or prune stops the keeper's thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import ssl
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from elastic._agent.launcher import keeper_bucket
from elastic._agent.launcher.keeper_directory import DirectoryPersister
from elastic._agent.launcher.keeper_endpoint import serve
from elastic._agent.launcher.keeper_files import (
    OWNER_FILE,
    live_keepers_of,
    owner_record,
    pid_alive,
    private_directory,
    remove_orphans,
    snapshot_base,
)
from elastic._agent.launcher.keeper_receive import ReplicaReceiver
from elastic._agent.launcher.keeper_space import UploadSpace
from elastic._agent.timings import CLOSE_GRACE, PRUNE_EVERY, STALE_UPLOAD
from elastic._shared.common import threads
from elastic._shared.storage import parts
from elastic._shared.storage.keeper_address import (
    LOCAL,
    REPLICA,
    KeeperAddress,
)
from elastic._shared.storage.location import is_url
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.peer_auth import PeerKey

logger = logging.getLogger(__name__)

RESERVE_FRACTION = 0.10
"""A replica is refused (507) when storing it would leave less than this share of the keeper's file
system free: /dev/shm is also where workers' own snapshots and DataLoader workers' tensors go."""


class SnapshotKeeper:
    """One node's keeper (see the module docstring). `close()` removes its directory."""

    def __init__(
        self, host: str, *, key: PeerKey, run_id: str, base: Path | None = None, tls: ssl.SSLContext | None = None,
        secret_file: Path | None = None,
    ) -> None:
        self.host = host
        self.run_id = run_id
        self.secret_file = secret_file
        """Where the workers read the job's secret (None: they have it from the environment)."""
        base = private_directory(base or snapshot_base())
        remove_orphans(base)
        self.node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.root = base / self.node
        for name in (LOCAL, REPLICA):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        (self.root / OWNER_FILE).write_text(json.dumps(owner_record(run_id)))
        self._replicas = ReplicaReceiver(self.root, self.root / REPLICA, run_id,
                                         UploadSpace(self.root / REPLICA, RESERVE_FRACTION))
        self._server = serve(self, host, key, tls)
        port = self._server.server_address[1]
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        self._lock = threading.Lock()  # persist and prune never overlap
        self._closing = threading.Event()
        self._persist_wanted = threading.Event()
        self._directories = DirectoryPersister(run_id)
        self.persisted: list[int] = []
        """Steps this keeper committed to a checkpoint directory."""
        self._threads = [
            threads.start(self._server.serve_forever, name="snapshot-keeper-http", stop=self._server.shutdown),
            threads.start(self._maintain, name="snapshot-keeper", stop=self._closing.set),
            threads.start(self._watch_connections, name="snapshot-keeper-deadlines", stop=self._closing.set),
        ]

    @property
    def address(self) -> KeeperAddress:
        return KeeperAddress(self.root, self.url, self.node, self.secret_file)

    # -- the agent's events --------------------------------------------------------

    def workers_stopped(self) -> None:
        """The agent stopped its workers: persist the newest snapshot (soon, on the keeper's thread)."""
        self._persist_wanted.set()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no persist is wanted or running (the agent is about to exit)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._persist_wanted.is_set() and self._lock.acquire(timeout=0.1):
                self._lock.release()
                return True
            time.sleep(0.05)
        return False

    def close(self, timeout: float = 300.0) -> bool:
        """Finish a persist that is wanted, stop serving, remove the directory; all within `timeout`
        seconds (and `CLOSE_GRACE` more for the cleanup), whatever hangs: a persist stuck on a dead
        mount holds the lock, and the cleanup touches that mount too. False (one warning) when it
        gave up; the directory then stays for the next keeper on this host (`remove_orphans`)."""
        deadline = time.monotonic() + timeout
        if not self.wait_idle(timeout):
            logger.warning("snapshot keeper: persisting the newest snapshot did not finish within %g s", timeout)
        self._closing.set()
        self._server.shutdown()  # serve_forever polls: bounded; handlers are daemon threads, never joined
        self._server.server_close()
        cleanup = threads.start(self._clean_up, name="snapshot-keeper-close")
        cleanup.join(max(0.0, deadline - time.monotonic()) + CLOSE_GRACE)
        if cleanup.is_alive():
            logger.warning("snapshot keeper: gave up cleaning up after %g s (a persist or the storage hangs); "
                           "%s stays until the next keeper on this host", timeout + CLOSE_GRACE, self.root)
            return False
        return True

    def _clean_up(self) -> None:
        with self._lock:
            self._directories.remove_unfinished(self._local_ranks)
            shutil.rmtree(self.root, ignore_errors=True)
            self._directories.remove_old()
            with contextlib.suppress(OSError):
                if self.secret_file is not None and not live_keepers_of(self.root.parent, self.run_id):
                    # The run's secret file on this host (made, or given and written here): no keeper
                    # of the run is left to use it.
                    self.secret_file.unlink(missing_ok=True)
                    with contextlib.suppress(OSError):
                        self.secret_file.parent.rmdir()  # when no other run's secret is left in it

    def _watch_connections(self) -> None:
        """Shut connections whose headers are late (keeper_endpoint.HEADER_SECONDS), and touch owner.json
        (the heartbeat keepers of other pid namespaces judge this one by), once a second."""
        while not self._closing.wait(1.0):
            self._server.shut_late_connections()  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                os.utime(self.root / OWNER_FILE)

    def _maintain(self) -> None:
        while not self._closing.is_set():
            wanted = self._persist_wanted.wait(PRUNE_EVERY)
            with self._lock:
                if self._closing.is_set():
                    return
                if wanted:
                    self._persist_wanted.clear()
                    try:
                        self.persisted += self.persist()
                    except Exception:
                        logger.exception("snapshot keeper: persisting the newest snapshot failed")
                try:
                    self.prune()
                except Exception as exc:  # noqa: BLE001 - as above: a bad file is skipped, the keeper goes on
                    logger.warning("snapshot keeper: removing old parts failed: %s: %s", type(exc).__name__, exc)

    # -- persist -------------------------------------------------------------------

    def _local_ranks(self, world_size: int) -> set[int]:
        return {h.rank for path, h in self.held() if h.world_size == world_size and path.parent.name == LOCAL}

    def held(self) -> list[tuple[Path, PartHeader]]:
        """(data file, header) of every part in this node's memory, its own and its peer's."""
        found = []
        for where in (LOCAL, REPLICA):
            for header in parts.read_headers(self.root / where):
                found.append((self.root / where / (header.stem + parts.DATA_SUFFIX), header))
        return found

    def persist(self) -> list[int]:
        """Write the newest snapshot held here into its job's checkpoint directory (see the module
        docstring); the steps committed by this keeper."""
        targets: dict[tuple[str, str, int, int, str], dict[int, list[tuple[Path, PartHeader]]]] = {}
        held = self.held()
        # Only where this node's own workers checkpoint: a peer's upload cannot name a directory.
        declared = {(h.ckpt_dir, h.keep) for path, h in held if path.parent.name == LOCAL}
        for path, header in held:
            if (header.ckpt_dir, header.keep) not in declared:
                continue
            generation = str(header.extra.get("generation", ""))
            steps = targets.setdefault((header.ckpt_dir, header.run_id, header.world_size, header.keep, generation), {})
            steps.setdefault(header.step, []).append((path, header))
        committed: list[int] = []
        for (ckpt_dir, run_id, world_size, keep, generation), steps in targets.items():
            if is_url(ckpt_dir):  # a bucket: the same commit through its own primitives
                if run_id == self.run_id:
                    committed += keeper_bucket.persist(ckpt_dir, run_id=run_id, world_size=world_size, keep=keep,
                                                       generation=generation, steps=steps)
                continue
            if Path(ckpt_dir).is_dir() and run_id == self.run_id:
                committed += self._directories.persist(Path(ckpt_dir), world_size=world_size, keep=keep,
                                                       generation=generation, steps=steps)
        return committed

    # -- housekeeping --------------------------------------------------------------

    def prune(self) -> None:
        """Remove parts nobody needs any more (see the module docstring)."""
        local = self.root / LOCAL
        headers = parts.read_headers(local)
        live = [h for h in headers if pid_alive(parts.writer_pid(h.writer))]
        for entry in os.scandir(local):
            parsed = parts.parse_part_name(entry.name)
            if parsed is None:
                continue
            _, writer, _, _ = parsed
            if pid_alive(parts.writer_pid(writer)):
                continue
            own = [h for h in headers if h.writer == writer]
            # A dead writer's parts go once a live writer of a later generation (a restore since) has
            # written a newer snapshot: that restore is over. A live writer of the dead one's own
            # generation (a peer rank, not yet stopped by its agent) does not count: the agent is
            # about to persist that generation's newest step, which needs the dead writer's part.
            newer = [h.step for h in live
                     if not own or (_generation(h) != _generation(own[0]) and h.step >= max(o.step for o in own))]
            if newer:
                Path(entry.path).unlink(missing_ok=True)
        self._prune_replicas()

    def _prune_replicas(self) -> None:
        replica = self.root / REPLICA
        headers = parts.read_headers(replica)
        keep: set[str] = set()
        by_rank: dict[int, list[PartHeader]] = {}
        for header in headers:
            by_rank.setdefault(header.rank, []).append(header)
        for group in by_rank.values():
            steps = sorted({h.step for h in group}, reverse=True)[:2]
            keep.update(h.stem for h in group if h.step in steps)
        now = time.time()
        for entry in os.scandir(replica):
            parsed = parts.parse_part_name(entry.name)
            if parsed is None:
                if entry.name.startswith(".") and now - entry.stat().st_mtime > STALE_UPLOAD:
                    Path(entry.path).unlink(missing_ok=True)  # an upload that died
                continue
            stem = entry.name.rsplit(".", 1)[0]
            has_header = (replica / (stem + parts.HEADER_SUFFIX)).exists()
            if stem not in keep and (has_header or now - entry.stat().st_mtime > STALE_UPLOAD):
                Path(entry.path).unlink(missing_ok=True)

    # -- receiving a peer's part ---------------------------------------------------

    def receive(self, stem: str, head: bytes, body: Any, length: int, tag: Any) -> None:
        """Store a peer's part (see keeper_endpoint.PartHolder, keeper_receive.py)."""
        self._replicas.receive(stem, head, body, length, tag)


def _generation(header: PartHeader) -> str:
    return str(header.extra.get("generation", ""))
