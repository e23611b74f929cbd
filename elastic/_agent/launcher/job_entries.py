"""A job's failures and hangs as the agents name them: notice-board entries and event-log lines.

What elastic._agent.launcher.job_watch posts and writes, made from torch's record of a failed
worker and from the workers' notes (elastic._shared.protocol.worker_notes): each worker named by
rank, node and host, with the last step it completed.

Invariants: a worker's note is read bounded and checked field by field (a note that is not a hang
verdict makes no entry); an event-log line is written whole, appended, to a file this agent's
workers named (never through a link), and a write that fails is one warning, never an exception.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic._agent.launcher import failure_policy
from elastic._agent.launcher.failure_policy import Failure
from elastic._agent.launcher.hang_verdicts import since_of
from elastic._agent.launcher.notice_board import Entry
from elastic._shared.protocol import worker_notes
from elastic._shared.storage.keeper_address import NODE_ENV

logger = logging.getLogger(__name__)

COUNTED = {"failure": "job_failures", "hang": "job_hangs_named", "node_excluded": "nodes_set_aside"}
"""The board's entries the workers' metrics count, by the metric's name (worker_notes.INCIDENTS)."""


def node_name(environ: Any = None) -> str:
    """This node as the workers name it too: the snapshot keeper's node name, else the host name."""
    env = os.environ if environ is None else environ
    return (env.get(NODE_ENV) or socket.gethostname())[:200]


def make_notes_directory(environ: Any = None) -> Path:
    """A private directory for this agent's workers' notes, named in their environment."""
    env = os.environ if environ is None else environ
    directory = Path(tempfile.mkdtemp(prefix="torchrevive-notes-"))
    env[worker_notes.NOTES_ENV] = str(directory)
    return directory


def failure_of(process_failure: Any, *, global_rank: int, notes: str | None, now: float) -> Failure:
    """A worker's failure from torch's record of it (`ProcessFailure`) and the worker's progress note."""
    message = process_failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = failure_policy.first_line(message if isinstance(message, str) else "")
    if not text or text.startswith("To enable traceback"):
        text = failure_policy.how_it_ended(process_failure.exitcode)
    step = worker_notes.read_progress(notes, process_failure.local_rank) if notes else None
    return Failure(
        rank=global_rank, node=node_name(), host=socket.gethostname()[:200], exitcode=int(process_failure.exitcode),
        step=-1 if step is None else step, error=text, time=now,
        primary=not failure_policy.is_collateral(int(process_failure.exitcode), text),
    )


def world_of(worker_group: Any) -> int:
    return int(worker_group.workers[0].world_size) if worker_group.workers else 0


def restart_number(agent: Any, worker_group: Any) -> int:
    remaining = getattr(agent, "_remaining_restarts", None)
    return int(worker_group.spec.max_restarts) - remaining if isinstance(remaining, int) else 0


def last_step(failures: list[Failure]) -> int:
    return failures[-1].step if failures else -1


def hang_entry(note: dict[str, Any], worker_group: Any) -> Entry | None:
    """A worker's hang verdict as an entry; None when the note is not one (checked field by field)."""
    line, step, culprits = note.get("line"), note.get("step"), note.get("culprits")
    if not isinstance(line, str) or type(step) is not int or not isinstance(culprits, list):
        return None
    names = ("culprits", "nodes", "hosts", "collective", "stack_tops", "last_done", "reasons", "answered")
    fields = {name: note[name] for name in names if name in note}
    since = since_of(note)
    if since is not None:
        fields["since"] = since
    if any(type(rank) is not int for rank in culprits):
        return None
    text = "".join(ch if ch.isprintable() else " " for ch in line[:1400])
    return Entry("hang", text, time.time(), step, world_of(worker_group), node_name(), fields)


def append_event(path: str, entry: Entry, *, restart: int) -> None:
    """The entry as one line of the job's event log (whole, appended; the log is a record, not state)."""
    record = {"event": entry.kind, "time": entry.time, "step": entry.step, "world_size": entry.world_size,
              "restart": restart, **entry.fields}
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    except OSError as error:
        logger.warning("event log %s: %s; the %s event is not written", path, error.strerror or error, entry.kind)
        return
    try:
        os.write(fd, data)
    except OSError as error:
        logger.warning("event log %s: %s; the %s event is not written", path, error.strerror or error, entry.kind)
    finally:
        os.close(fd)
