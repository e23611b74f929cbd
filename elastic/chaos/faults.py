"""Fault injection: kill this worker at a named point, for tests and fire drills.

Faults are asked for through the environment, so they reach workers that
torchrun starts without any change to the command line:

    ELASTIC_FAULT=before_commit@20          die on rank 0 just before step 20's
                                            checkpoint is committed
    ELASTIC_FAULT=after_step@15:rank=1      die on rank 1 after step 15
    ELASTIC_FAULT=after_step@8+:rank=any:restart=any
                                            die after step 8 or later, whichever rank the
                                            worker is, on every attempt (given to one agent
                                            only: a node whose workers crash at every start)
    ELASTIC_FAULT=...:restart=any           fire on every attempt, not only the first
    ELASTIC_FAULT=after_step@15:do=stop     SIGSTOP itself (a frozen host) instead
    ELASTIC_FAULT=after_step@15:do=hang     block its main thread forever (a deadlock)
    ELASTIC_FAULT=during_write@20+:do=enospc
                                            every save from step 20 on fails as on a
                                            full disk (rank 0's writer, after the
                                            first file is half written)
    ELASTIC_FAULT=during_write@20:do=slow:for=40
                                            step 20's save stalls 40 s (slow storage)
    ELASTIC_FAULT=during_read@20:do=slow:for=40
                                            restoring step 20's checkpoint stalls 40 s
                                            after its first chunk (slow storage on restore)
    ELASTIC_FAULT=before_read@0+:restart=1:do=hold:until=/tmp/go
                                            after the first restart, rank 0 holds before
                                            it reads any byte of the step it restores
                                            (every rank agreed on it, the nodes' parts
                                            are known) until /tmp/go exists
    ELASTIC_FAULT=during_snapshot@15:rank=1 die on rank 1 while it copies step 15's
                                            in-memory snapshot (data written, header not;
                                            snapshot_begun, _checksummed and _committed
                                            are the write's other phases)
    ELASTIC_FAULT=during_catch_up@6:rank=1:restart=1
                                            the replacement of rank 1 dies while it takes
                                            step 6's state from a live peer (a heal in place)
    ELASTIC_FAULT=during_all_reduce@7:rank=3
                                            rank 3 dies as step 7's gradient all-reduce starts
                                            (heals in place: its peers' step 7 is void)
    ELASTIC_FAULT=during_pause@6:rank=1      rank 1 dies as the work between steps after step
                                            6 starts (an evaluation in run.pause(): its peers'
                                            collective there fails; the step after it heals)
    ELASTIC_FAULT=after_step@20:do=hold:until=/tmp/go
                                            rank 0 holds after step 20 until the file
                                            /tmp/go exists, and creates /tmp/go.held as
                                            it begins to (a test's fault outside the
                                            job, e.g. an etcd outage, lands mid-run
                                            however fast the job trains)
    ELASTIC_FAULT=after_step@12:rank=1:do=flip
                                            one bit of one parameter of rank 1 flips after
                                            step 12's update (silent corruption: only the
                                            replica checks see it); once per worker, so a
                                            replay of step 12 runs clean; with restart=any
                                            at every attempt, replays included (a faulty node)
    ELASTIC_FAULT=after_step@7:rank=0:do=nan
                                            rank 0's loss of step 7 is NaN (its forward pass's
                                            outputs), before the update: for the numeric guard
    ELASTIC_FAULT=after_step@12:sample=301:do=flip
                                            one bit flips after step 12's update on whichever
                                            rank trained sample 301 in that step (at every
                                            attempt unless restart= says otherwise: a fault that
                                            follows the batch, not the rank; no flip when the
                                            step's update is skipped); with do=nan, that rank's
                                            loss of step 12 is NaN
    ELASTIC_FAULT=after_step@1+:do=slow:for=0.3:restart=any:world=1
                                            rank 0 paces every step to 0.3 s while the
                                            job trains at world size 1 (a job that must
                                            outlast a node joining it, however slow the
                                            join, and no longer than it needs)

The library marks the points (elastic._shared.protocol.fault_hook); `FaultInjector` is the
plugin that fills them, registered under the entry point group
`torchrevive.faults`, so a worker loads it only when ELASTIC_FAULT is set.

A fault fires only on restart 0 unless `restart=` says otherwise, so a job
that torchrun restarts after the fault runs on undisturbed. `world=N` limits it
to workers started at world size N (torch does not count a restart for a node
joining or leaving, so the restart count cannot tell those groups apart).
`once` makes a fault fire at most once in the whole job, whichever worker and
attempt reaches it first (with `restart=any` and `@N+`: the first time a worker
gets to step N or later): the worker that fires it first creates a file named
after the entry in `ELASTIC_FAULT_ONCE_DIR`, exclusively. That is how the
chaos harness chains several faults in one job without counting restarts. Several faults
are separated by commas; `@N+` matches step N and every later one. The
default death is SIGKILL: no handler, no flush, no cleanup runs, as when a
machine or the OOM killer takes a process. `stop` and `hang` leave the process
alive and silent: only hang detection (`elastic._worker.control.watchdog`) gets the job going
again. `enospc` and `slow` are storage faults: the first raises the OSError a
full disk gives, the second sleeps `for` seconds (default 30) in the writer.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from elastic._shared.common.errors import UsageError
from elastic._shared.protocol.fault_hook import ENV_VAR
from elastic._shared.protocol.fault_hook import POINTS as FAULT_POINTS

ACTIONS = ("kill", "stop", "hang", "enospc", "slow", "hold", "flip", "nan")
TAMPERING = ("flip", "nan")
"""Actions the worker makes itself when `tamper` says they are due (elastic._shared.protocol.fault_hook)."""
ONCE_DIR_ENV = "ELASTIC_FAULT_ONCE_DIR"
"""Where `once` faults leave a mark when they fire (one file each), so no other worker fires them."""


@dataclass(frozen=True)
class Fault:
    point: str
    step: int
    rank: int | None = 0
    """The rank it fires on; None: any (`rank=any`)."""
    restart: int | None = 0
    """The attempt (TORCHELASTIC_RESTART_COUNT) it fires on; None: every attempt."""
    action: str = "kill"
    onwards: bool = False
    """Fire at `step` and at every later step (`@N+`)."""
    seconds: float = 30.0
    """How long `slow` stalls."""
    world_size: int | None = None
    """The world size of the workers it fires in (WORLD_SIZE when the worker started); None: any."""
    once: bool = False
    """At most once in the whole job (a mark in ELASTIC_FAULT_ONCE_DIR)."""
    until: str = ""
    """The file `hold` waits for."""
    sample: int | None = None
    """flip/nan: the sample index whose rank it fires on (whichever trains it at the step), not a fixed rank."""
    entry: str = field(default="", compare=False)
    """The ELASTIC_FAULT entry it was parsed from (names its mark)."""

    def matches(self, point: str, step: int) -> bool:
        return self.point == point and (step >= self.step if self.onwards else step == self.step)


def parse_faults(text: str) -> list[Fault]:
    """Parse ELASTIC_FAULT; raises `UsageError` (one line) on a malformed entry."""
    faults = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        head, *options = entry.split(":")
        point, sep, step = head.partition("@")
        onwards = step.endswith("+")
        step = step.removesuffix("+")
        if point not in FAULT_POINTS or not sep or not step.isdigit():
            raise UsageError(f"{ENV_VAR} entry {entry!r} must look like POINT@STEP[+] with POINT one of {FAULT_POINTS}")
        fields: dict[str, int | str | float | bool | None] = {"onwards": onwards}
        for option in options:
            key, _, value = option.partition("=")
            if option == "once":
                fields["once"] = True
            elif key == "rank" and (value.isdigit() or value == "any"):
                fields["rank"] = None if value == "any" else int(value)
            elif key == "restart" and (value.isdigit() or value == "any"):
                fields["restart"] = None if value == "any" else int(value)
            elif key == "do" and value in ACTIONS:
                fields["action"] = value
            elif key == "for" and value.replace(".", "", 1).isdigit():
                fields["seconds"] = float(value)
            elif key == "until" and value:
                fields["until"] = value
            elif key == "world" and value.isdigit() and int(value) > 0:
                fields["world_size"] = int(value)
            elif key == "sample" and value.isdigit():
                fields["sample"] = int(value)
            else:
                raise UsageError(
                    f"{ENV_VAR} option {option!r} in {entry!r} is not rank=N|any, restart=N|any, world=N, once, "
                    f"for=SECONDS, until=FILE, sample=N or do={'|'.join(ACTIONS)}"
                )
        if (fields.get("action") == "hold") != bool(fields.get("until")):
            raise UsageError(f"{ENV_VAR} entry {entry!r}: do=hold goes with until=FILE, and until=FILE with do=hold")
        if "sample" in fields:
            if fields.get("action") not in TAMPERING or "rank" in fields:
                raise UsageError(f"{ENV_VAR} entry {entry!r}: sample=N goes with do=flip or do=nan and no rank= "
                                 "(it fires on whichever rank trains sample N)")
            fields["rank"] = None
            fields.setdefault("restart", None)  # a batch goes wrong at every attempt: that is what tells it from a node
        faults.append(Fault(point, int(step), entry=entry, **fields))  # type: ignore[arg-type]
    return faults


class FaultInjector:
    """The faults meant for this worker; `at(point, step)` kills it when one matches (an
    `elastic._shared.protocol.fault_hook.FaultHook`)."""

    def __init__(self, rank: int, restart: int, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        world = env.get("WORLD_SIZE", "")
        world_size = int(world) if world.isdigit() else None
        self._faults = [
            f for f in parse_faults(env.get(ENV_VAR, ""))
            if f.rank in (None, rank) and f.restart in (None, restart) and f.world_size in (None, world_size)
        ]
        self._tampered: set[Fault] = set()  # flips and NaNs fired by this worker (restart=N: once each)
        self._once_dir = env.get(ONCE_DIR_ENV) or None
        if self._once_dir is None and any(f.once for f in self._faults):
            raise UsageError(f"{ENV_VAR} has a fault marked once, which needs {ONCE_DIR_ENV} (a folder every worker shares)")

    def tamper(self, point: str, step: int, action: str, samples: Collection[int] = ()) -> bool:
        """Whether the flip or NaN `action` is due here: on the worker's first attempt at the step only
        (a replay after a rollback runs clean), or at every attempt with restart=any. A `sample=` fault
        is due only where `samples` (what this rank trains in the step) hold its sample."""
        for fault in self._faults:
            if fault.action != action or action not in TAMPERING or not fault.matches(point, step):
                continue
            if fault.sample is not None and fault.sample not in samples:
                continue
            if fault.restart is not None and fault in self._tampered:
                continue
            if fault.once and not self._first_to_fire(fault):
                continue
            self._tampered.add(fault)
            return True
        return False

    def at(self, point: str, step: int) -> None:
        for fault in self._faults:
            if fault.action in TAMPERING:
                continue  # made by the worker itself (`tamper`)
            if fault.matches(point, step) and (not fault.once or self._first_to_fire(fault)):
                if fault.action == "hang":
                    threading.Event().wait()  # never set: this thread is stuck for good
                if fault.action == "slow":
                    time.sleep(fault.seconds)
                    continue
                if fault.action == "hold":
                    open(fault.until + ".held", "a").close()  # for whoever waits for the hold to begin
                    while not os.path.exists(fault.until):
                        time.sleep(0.05)
                    continue
                if fault.action == "enospc":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"injected by {ENV_VAR}")
                os.kill(os.getpid(), signal.SIGSTOP if fault.action == "stop" else signal.SIGKILL)

    def _first_to_fire(self, fault: Fault) -> bool:
        """Mark `fault` as fired for the whole job; False when a worker marked it before."""
        assert self._once_dir is not None
        mark = os.path.join(self._once_dir, hashlib.sha256(fault.entry.encode()).hexdigest()[:16])
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        return True
