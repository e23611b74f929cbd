"""Which job writes a checkpoint directory: `writer.json`, the claim.

Invariants:
- One job writes a directory at a time. Rank 0 claims it at restore (`claim`),
  refusing (one line, `CheckpointStorageError`) a directory another live job
  writes, and keeps the claim fresh (`refresh`) between rare commits.
- A writer is never named by a bare pid, which a restarted container's fresh
  pid namespace hands out again: it is (boot id, pid namespace, pid, start
  time of that pid), plus its run id. Whether it still lives (`alive`):
  * same kernel (boot id), same pid namespace: alive exactly when that pid is
    a process that started at the recorded time;
  * same kernel, another pid namespace: alive when a process of that
    namespace we can see (a child namespace) is it; else, from the same
    network namespace, when its liveness token is still held (liveness.py:
    a container restarted on the host's network finds its previous life's
    token free); else (another network namespace: a container beside this
    one, or this one's previous life) by its heartbeat. A writer out of
    sight is never taken for dead for that alone: containers side by side
    (`--ipc=host --network=host`) share a host name, not their pids;
  * another kernel: the same host name means this machine rebooted (dead);
    another host is judged by its heartbeat (`stale_after`).
- Same run id (a real one, not the anonymous "local"/"none" of single-process
  or unnamed runs): the same job restarting, which takes over; its old rank 0
  is refused at its next commit. Any other live writer is another job: refused.
- A job that ends cleanly (finished, preempted, stopped for its storage) marks
  its claim as ended (`release`: heartbeat 0): the next job, on any host,
  takes the directory at once instead of waiting `stale_after` for a writer
  on another host to go stale. A job that fails keeps its claim live.
- Every commit checks the claim just before its rename (`check_may_commit`):
  rank 0 commits only while the claim is still its own; a snapshot keeper,
  which commits on behalf of its job's workers, only while the claim is its
  job's (same run id). A writer that lost the directory commits nothing there.
- writer.json is untrusted input: read only as a small regular file (a FIFO
  or a device there is refused without blocking, validate.read_bounded); a
  claim with a field of the wrong type or out of range (or of an older
  release, lacking the process identity) counts as none, with one warning.
  A claim is replaced atomically (durable.replace_small).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from elastic._shared.common.errors import CheckpointStorageError, CorruptCheckpoint
from elastic._shared.storage import liveness
from elastic._shared.storage.durable import SaveFailed, replace_small
from elastic._shared.storage.validate import read_bounded

logger = logging.getLogger(__name__)

WRITER = "writer.json"
ANONYMOUS_RUNS = frozenset({"", "local", "none"})
"""Run ids that do not name a job: every single-process run is "local", a torchrun job without --rdzv-id "none"."""
_PID_MAX = 2**22  # the kernel's upper bound for pid_max
_BOOT_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_WRITER_ID = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")
MAX_CLAIM_BYTES = 64 * 1024
_warned: set[tuple[str, str]] = set()


# -- what survives pid reuse -------------------------------------------------------------


def boot_id() -> str:
    """This kernel's boot id ("" where /proc does not say)."""
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return text if _BOOT_ID.match(text) else ""


def pid_namespace(pid: int | str = "self") -> int:
    """The inode of `pid`'s pid namespace (0 where it cannot be read)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


def start_time(pid: int | str) -> int | None:
    """When process `pid` (as /proc shows it) started, in clock ticks since boot (field 22 of
    /proc/<pid>/stat); None when no such process is visible."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        # The command name (field 2) may hold spaces and parentheses: count from its closing one.
        return int(text[text.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def started_at(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch, to a clock tick (10 ms); None when no such
    process is visible. Its start time counts from boot on the boot-time clock, which this process reads
    now too; /proc/stat's `btime` would do instead, but it is whole seconds, and a process that started
    half a second after a hang's stall began must not read as one that ran before it."""
    ticks = start_time(pid)
    if ticks is None:
        return None
    try:  # the boot-time clock read on both sides of the epoch clock: a preemption between halves its error
        before = time.clock_gettime(time.CLOCK_BOOTTIME)
        now = time.time()
        after = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # not Linux
        return None
    return now - ((before + after) / 2 - ticks / os.sysconf("SC_CLK_TCK"))


def _own_start_time() -> int:
    """This process's start time, or -1 when /proc shows another pid namespace than ours
    (a `unshare -p` without a fresh /proc): then our pid cannot be checked through it."""
    try:
        text = Path("/proc/self/stat").read_text(encoding="ascii", errors="replace")
        if int(text.split(" ", 1)[0]) != os.getpid():
            return -1
    except (OSError, ValueError):
        return -1
    started = start_time("self")
    return -1 if started is None else started


def _nspid(pid: str) -> int | None:
    """`pid`'s pid in its own (innermost) namespace, from /proc/<pid>/status."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _seen_in_namespace(namespace: int, pid: int, started: int) -> bool | None:
    """Whether a process we can see lives in pid namespace `namespace` as `pid`, started at
    `started`: True/False when some process of that namespace is visible, None when none is."""
    seen = False
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        if pid_namespace(entry) != namespace:
            continue
        seen = True
        if _nspid(entry) == pid and start_time(entry) == started:
            return True
    return False if seen else None


# -- the claim ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WriterIdentity:
    """Who writes a checkpoint directory (writer.json): one per rank 0 of a job's run."""

    writer: str
    """Unique per writing process (a new rank 0 after a restart is a new writer)."""
    run_id: str
    host: str
    pid: int
    """In the writer's own pid namespace (`pid_ns`); meaningless without `start_time`."""
    heartbeat: float
    stale_after: float = 1800.0
    """A claim older than this (seconds since its heartbeat) whose process cannot be checked is taken to be dead."""
    boot_id: str = ""
    """The writer's kernel (/proc/sys/kernel/random/boot_id); "" unknown."""
    pid_ns: int = 0
    """The inode of the writer's pid namespace; 0 unknown."""
    start_time: int = -1
    """The writer's start time, clock ticks since boot (/proc/<pid>/stat field 22); -1 unknown."""
    net_ns: int = 0
    """The inode of the writer's network namespace, where its `token` can be judged; 0 unknown."""
    token: str = ""
    """The writer's liveness token (liveness.py), "" none."""

    @classmethod
    def new(cls, run_id: str, *, stale_after: float = 1800.0) -> WriterIdentity:
        return cls(
            uuid.uuid4().hex[:12], run_id, socket.gethostname(), os.getpid(), time.time(), stale_after,
            boot_id(), pid_namespace(), _own_start_time(), liveness.net_namespace(), liveness.own_token(),
        )

    @classmethod
    def of_process(cls, run_id: str, pid: int, *, writer: str | None = None, host: str | None = None,
                   heartbeat: float | None = None) -> WriterIdentity:
        """The identity of process `pid` (as this process's /proc shows it) as a writer."""
        started = start_time(pid)
        return cls(
            writer or uuid.uuid4().hex[:12], run_id, host or socket.gethostname(), pid,
            time.time() if heartbeat is None else heartbeat, 1800.0, boot_id(), pid_namespace(pid),
            -1 if started is None else started,
        )

    def beat(self) -> WriterIdentity:
        return WriterIdentity(**{**asdict(self), "heartbeat": time.time()})

    def same_process(self, other: WriterIdentity) -> bool:
        """Whether both name one process: a bare pid never suffices."""
        return (
            bool(self.boot_id) and self.pid_ns != 0 and self.start_time >= 0
            and (self.boot_id, self.pid_ns, self.pid, self.start_time)
            == (other.boot_id, other.pid_ns, other.pid, other.start_time)
        )

    def alive(self, observer: WriterIdentity) -> bool:
        """Whether this claim's writer may still be writing, as `observer` can tell (module docstring)."""
        if self.boot_id and self.boot_id == observer.boot_id and self.start_time >= 0:
            if self.pid_ns == observer.pid_ns and observer.start_time >= 0:
                return start_time(self.pid) == self.start_time
            if self.pid_ns != observer.pid_ns and self.pid_ns != 0:
                seen = _seen_in_namespace(self.pid_ns, self.pid, self.start_time)
                if seen is not None:
                    return seen
                if self.token and self.net_ns != 0 and self.net_ns == observer.net_ns:
                    held = liveness.token_alive(self.token)
                    if held is not None:
                        return held
                # Out of sight (a container beside this one shares our host name): only its heartbeat tells.
        elif self.boot_id and observer.boot_id and self.boot_id != observer.boot_id and self.host == observer.host:
            return False  # this host rebooted since
        return time.time() - self.heartbeat < self.stale_after

    def describe(self) -> str:
        return f"run {self.run_id} on {self.host}, pid {self.pid}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> WriterIdentity:
        """A claim read from writer.json; `ValueError` (`TypeError`) naming the first field that is wrong."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        identity = cls(
            writer=_text(raw, "writer", 64), run_id=_text(raw, "run_id", 256), host=_text(raw, "host", 255),
            pid=_integer(raw, "pid", 1, _PID_MAX), heartbeat=_number(raw, "heartbeat", 0.0, 1e11),
            stale_after=_number(raw, "stale_after", 1.0, 1e9), boot_id=_text(raw, "boot_id", 36),
            pid_ns=_integer(raw, "pid_ns", 0, 2**64 - 1), start_time=_integer(raw, "start_time", -1, 2**63 - 1),
            # Optional: a claim of the release before them is judged by its heartbeat where they would count.
            net_ns=_integer(raw, "net_ns", 0, 2**64 - 1) if "net_ns" in raw else 0,
            token=_text(raw, "token", 32) if "token" in raw else "",
        )
        if not _WRITER_ID.match(identity.writer):
            raise ValueError("writer is not a writer id")
        if identity.boot_id and not _BOOT_ID.match(identity.boot_id):
            raise ValueError("boot_id is not a boot id")
        if identity.token and not liveness.TOKEN.match(identity.token):
            raise ValueError("token is not a liveness token")
        return identity


def _text(raw: dict, name: str, longest: int) -> str:
    value = raw.get(name)
    if not isinstance(value, str) or len(value) > longest or not value.isprintable():
        raise ValueError(f"{name} is not a printable string of at most {longest} characters")
    return value


def _integer(raw: dict, name: str, low: int, high: int) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} is not an integer from {low} to {high}")
    return value


def _number(raw: dict, name: str, low: float, high: float) -> float:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{name} is not a number from {low:g} to {high:g}")
    return float(value)


def current(root: Path) -> WriterIdentity | None:
    """Who claimed `root` last (None: nobody, or a claim that is unreadable or invalid: one warning each)."""
    try:
        # Bounded: a FIFO, a device or a huge file there is refused without blocking or filling memory.
        text = read_bounded(root / WRITER, WRITER, MAX_CLAIM_BYTES).decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, CorruptCheckpoint) as exc:
        _warn_once(root, f"cannot read it: {exc}")
        return None
    try:
        return WriterIdentity.from_json(text)
    except (ValueError, TypeError, RecursionError) as exc:
        _warn_once(root, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def _warn_once(root: Path, why: str) -> None:
    key = (str(root), why)
    if key not in _warned:
        _warned.add(key)
        logger.warning("ignoring the claim in %s (%s): it counts as none", root / WRITER, why)


def claim(root: Path, identity: WriterIdentity) -> None:
    """Make `identity` the directory's writer; `CheckpointStorageError` if another live job writes here."""
    judge_takeover(current(root), identity, str(root), str(root / WRITER))
    replace_small(root, WRITER, identity.to_json())


def judge_takeover(holder: WriterIdentity | None, identity: WriterIdentity, where: str, claim_file: str) -> None:
    """Whether `identity` may claim `where`, which `holder` claimed last: `CheckpointStorageError`
    if another live job writes there; a warning when it takes over from one that is gone.
    (The same judgement for a directory and a bucket: object_store/bucket_claim.py.)"""
    if holder is not None and holder.writer != identity.writer:
        same_job = holder.run_id == identity.run_id and holder.run_id not in ANONYMOUS_RUNS
        # An earlier writer in this very process (a manager made again) is no other job.
        if not same_job and not holder.same_process(identity) and holder.alive(identity):
            raise CheckpointStorageError(
                f"{where} is written by another job ({holder.describe()}, "
                f"seen {max(0.0, time.time() - holder.heartbeat):.0f} s ago): give each job its own --ckpt-dir "
                f"(or delete {claim_file} if that job is gone)"
            )
        if not same_job and not holder.same_process(identity):
            logger.warning("taking over %s from %s, which is gone", where, holder.describe())


def refresh(root: Path, identity: WriterIdentity) -> None:
    """Refresh the claim (a job that saves rarely still looks alive); `SaveFailed` if it was lost."""
    check_may_commit(root, identity.run_id, identity)
    replace_small(root, WRITER, identity.beat().to_json())


def refresh_after_commit(root: Path, identity: WriterIdentity) -> None:
    """After a commit: the claim's heartbeat is the commit's time, unless a newer claim replaced it."""
    holder = current(root)
    if holder is None or holder.writer == identity.writer:
        replace_small(root, WRITER, identity.beat().to_json())


def release(root: Path, identity: WriterIdentity) -> None:
    """`identity`'s job ended: its claim stays (its run id, for a snapshot keeper persisting for it) with
    a heartbeat of 0, which no host takes for alive, so the next job on any host claims the directory
    at once. Nothing changes when another writer holds the claim by now."""
    holder = current(root)
    if holder is not None and holder.writer == identity.writer:
        replace_small(root, WRITER, WriterIdentity(**{**asdict(identity), "heartbeat": 0.0}).to_json())


def check_may_commit(root: Path, run_id: str, owner: WriterIdentity | None = None) -> None:
    """`SaveFailed` unless the directory is still `owner`'s (rank 0), or, without an owner, still
    claimed by a writer of run `run_id` (a keeper committing for its job's workers)."""
    judge_commit(current(root), str(root), run_id, owner)


def judge_commit(holder: WriterIdentity | None, where: str, run_id: str, owner: WriterIdentity | None) -> None:
    """`SaveFailed` unless `holder` (the claim on `where`) lets `owner`, or without one run `run_id`, commit."""
    if holder is None:
        return
    if owner is not None and holder.writer != owner.writer:
        raise SaveFailed(f"{where} is now written by another writer ({holder.describe()}); this one stops writing there")
    if owner is None and holder.run_id != run_id:
        raise SaveFailed(
            f"{where} is now written by another job (run {holder.run_id} on {holder.host}); "
            f"nothing of run {run_id} is committed there"
        )
