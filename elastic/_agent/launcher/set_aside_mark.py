"""A host's mark that its node was set aside from a run: an agent started there waits out the cool-off.

`write` notes it (elastic._agent.launcher.job_watch, as the node leaves); `held_until` reads it back and
`wait_out_cool_off` (the launcher, before it joins) prints one line and waits until the cool-off ends.

Invariants: the mark lives in this user's own directory under the system's temporary directory, and
is believed only there (a directory that is not this user's, or that others may write, is ignored: a
stranger who made it first could hold the host back); it is read bounded and checked (a finite time, a
reason of text); a wait never exceeds the cool-off setting, whatever the mark says.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic._agent.launcher.failure_policy import DEFAULTS, SET_ASIDE_COOL_OFF_ENV
from elastic._shared.protocol import worker_notes

logger = logging.getLogger(__name__)


def cool_off(environ: Any) -> float:
    """--set-aside-cool-off (checked by settings.resolve before the agent starts; the default when unset)."""
    return float(environ.get(SET_ASIDE_COOL_OFF_ENV) or DEFAULTS[SET_ASIDE_COOL_OFF_ENV])


def _mark_path(environ: Any) -> Path:
    run_id = environ.get("TORCHELASTIC_RUN_ID") or environ.get("PET_RDZV_ID") or "none"
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"torchrevive-{os.getuid()}" / f"set-aside-{digest}.json"


def _private(directory: Path) -> bool:
    """Whether `directory` is this user's own and no one else's to write (a stranger's, made first under
    the shared temporary directory, could plant a mark that holds this host back)."""
    try:
        info = os.lstat(directory)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def write(environ: Any, line: str, seconds: float, *, run_id: str | None = None) -> None:
    """Note on this host that the node is set aside from the run until the cool-off ends."""
    path = _mark_path({**environ, "PET_RDZV_ID": run_id} if run_id else environ)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
    except OSError as error:
        logger.warning("cannot note the set-aside on this host (%s): a new agent here would rejoin at once", error)
        return
    if not _private(path.parent) or not worker_notes.write_json(path, {"until": time.time() + seconds,
                                                                        "why": line[:1000]}):
        logger.warning("cannot note the set-aside in %s (not this user's private directory, or not writable): "
                       "a new agent here would rejoin at once", path.parent)


def held_until(environ: Any, *, run_id: str, now: float | None = None) -> tuple[float, str] | None:
    """(until, why) while this host's mark for `run_id` holds; None otherwise (no mark, an old one, not one)."""
    path = _mark_path({**environ, "PET_RDZV_ID": run_id})
    note = worker_notes.read_json(path) if _private(path.parent) else None
    if note is None:
        return None
    until, why = note.get("until"), note.get("why")
    if not isinstance(until, (int, float)) or isinstance(until, bool) or not math.isfinite(until) or not isinstance(why, str):
        return None
    now = time.time() if now is None else now
    return (min(until, now + cool_off(environ)), why) if until > now else None


def wait_out_cool_off(environ: Any, run_id: str, *, sleep: Any = time.sleep) -> None:
    """Before joining: while this host is set aside from `run_id`, one line and a wait until the cool-off ends."""
    held = held_until(environ, run_id=run_id)
    if held is None:
        return
    until, why = held
    print(f"torchrevive-run: this host was set aside from run {run_id} ({why}); it rejoins in "
          f"{until - time.time():.0f} s, when the cool-off ends", file=sys.stderr, flush=True)
    sleep(max(0.0, until - time.time()))
