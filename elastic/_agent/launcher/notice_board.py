"""The job's notice board: what one agent learns of a failure, every agent reads, in the same order.

An entry is one JSON object: `kind` (`KINDS`: a worker's `failure`, a named `hang`, a node set aside,
`node_excluded`, a `crash_loop` that stops the job), the `line` every agent prints, the `time`, the
`step` and `world_size` it happened at, and the event's `fields`.

Where: the rendezvous store (a TCPStore under c10d), keys under `torchrevive/notices/RUN/`, through the
`SealedStore` the rendezvous handler gave torch's agent: every value sealed with the job's secret and
bound to the run, its launch and its key (an earlier launch's notice is not this one's), and read back
checked (elastic._shared.storage.store_records). Without a TCP store (an etcd rendezvous) the board is
this agent's own (`LocalBoard`): it sees its own node's entries only, and says so once.

No shared counter (whose value a stranger could move, hiding every later entry): entry k lives in slot
`nK`, and a poster claims the first slot it has not seen filled by compare-and-set, so slots fill in
order with no gap. A reader reads slots in order; a slot that reads as absent while the next one holds
an entry was emptied or forged by someone else, and is skipped with one warning. The first agent to
claim something (`claim`: an entry to write to the event log, the crash-loop decision) is the one whose
id a compare-and-set left there; who read a stop (`acknowledge`) is a sealed list of agent ids.

A look costs nothing while nothing is posted: a post is announced on the run's change signal
(change_signal.ChangeSignal, whose watcher blocks in the store), and a read happens only after the
generation moved, or every `FULL_READ_SECONDS` (every look read two keys before: 20 of the 31
operations a node a second of a quiet job, benchmarks/scale.py).

Invariants: an entry is at most `store_records.MAX_VALUE` characters of ASCII JSON; `read_new` reads at
most `MAX_PER_READ` entries per call and never waits on a key (`check` before `get`), and returns only
entries that parse (`Entry.parse`); one that does not is skipped with one warning, never retried. A post
tries at most `MAX_POST_TRIES` slots.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from elastic._agent.timings import FULL_READ_SECONDS
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.store_records import MAX_VALUE, Records

logger = logging.getLogger(__name__)

KINDS = ("failure", "hang", "node_excluded", "crash_loop")
MAX_PER_READ = 64
MAX_LINE = 1500
MAX_POST_TRIES = 4096
MAX_AGENT_ID = 80


@dataclass(frozen=True)
class Entry:
    kind: str
    line: str
    time: float
    step: int
    world_size: int
    node: str
    """The node of the agent that posted it."""
    fields: dict[str, Any]

    def dumps(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> Entry | None:
        try:
            raw = json.loads(text)
        except ValueError:
            return None
        if not isinstance(raw, dict) or set(raw) != set(cls.__dataclass_fields__):
            return None
        if raw["kind"] not in KINDS or not isinstance(raw["line"], str) or len(raw["line"]) > MAX_LINE:
            return None
        if not isinstance(raw["time"], (int, float)) or isinstance(raw["time"], bool) or not math.isfinite(raw["time"]):
            return None
        if type(raw["step"]) is not int or type(raw["world_size"]) is not int or not isinstance(raw["node"], str):
            return None
        if not isinstance(raw["fields"], dict) or not raw["line"].isprintable() or len(raw["node"]) > 300:
            return None
        return cls(**raw)


def fitted(entry: Entry) -> Entry:
    """`entry`, its line shortened until the whole fits one record."""
    while len(entry.dumps()) > MAX_VALUE and len(entry.line) > 80:
        entry = Entry(**{**entry.__dict__, "line": entry.line[: len(entry.line) // 2] + "..."})
    return entry


class StoreBoard:
    """The board in the rendezvous store (see the module docstring)."""

    shared = True

    def __init__(self, store: Any, run_id: str, environ: Any = None, changes: Any = None) -> None:
        """`store`: the round's sealed rendezvous store (in_place.heal_store); `changes`: the run's change
        signal (change_signal.ChangeSignal; None: none), on which a post is announced and by which a read
        learns that there may be something new."""
        import torch.distributed as dist

        scope = f"torchrevive/notices/{run_id}/"
        try:
            key = PeerKey.from_env(os.environ if environ is None else environ)
        except SecretError as error:
            logger.warning("the job's notices go unsealed: %s", error)
            key = None
        self._records = Records(dist.PrefixStore(scope, store), key=key, scope=scope)
        self._seen = 0
        """Slots read (n1 .. n_seen)."""
        self._free = 1
        """The lowest slot this agent has not seen filled."""
        self.agent_id = f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"
        self._changes = changes
        self._read_at: int | None = None
        """The change generation at the last read (with `changes`): no read until it moves."""
        self._full_read_at = float("-inf")

    def post(self, entry: Entry) -> int:
        """Add `entry` in the first slot not filled yet; its number."""
        text = fitted(entry).dumps()
        number = max(self._free, self._seen + 1)
        for _ in range(MAX_POST_TRIES):
            if not self._records.store.check([f"n{number + 1}"]) and self._records.compare_set(f"n{number}", text) == text:
                self._free = number + 1
                if self._changes is not None:
                    self._changes.announce()  # every agent's next look reads the board
                return number
            number += 1
        raise RuntimeError(f"the notice board has {MAX_POST_TRIES} entries this agent has not read")

    def read_new(self) -> list[tuple[int, Entry]]:
        """The entries after the last one read (at most MAX_PER_READ), in order. With a change signal, no
        store operation while no change was announced since the last read, except a full read (the
        slot after an empty one looked at too) every `FULL_READ_SECONDS`: a post whose announcement
        was lost, or a slot a stranger emptied, is read late, never lost."""
        full = True
        if self._changes is not None:
            generation, now = self._changes.latest(), time.monotonic()
            full = now >= self._full_read_at
            if generation == self._read_at and not full:
                return []
            self._read_at = generation
            if full:
                self._full_read_at = now + FULL_READ_SECONDS
        found: list[tuple[int, Entry]] = []
        while len(found) < MAX_PER_READ:
            number = self._seen + 1
            text = self._records.get(f"n{number}")
            if text is None:
                if not full or not self._records.store.check([f"n{number + 1}"]):
                    break  # nothing more yet
                self._records.warn_once(f"n{number}", "is missing before a later entry (emptied or forged)")
                self._seen = number
                continue
            self._seen = number
            entry = Entry.parse(text)
            if entry is None:
                self._records.warn_once(f"n{number}", "is not a notice")
                continue
            found.append((number, entry))
        return found

    def claim(self, number: int | str) -> bool:
        """Whether this agent is the first to claim `number` (an entry, to write it to the event log; or a
        name: the one decision of the job the first to claim it posts)."""
        return self._records.compare_set(f"claimed/{number}", self.agent_id) == self.agent_id

    def acknowledge(self, number: int) -> int:
        """Say this agent has read entry `number` (a stop); how many agents have said so."""
        self._records.store.append(f"read/{number}", f"{self.agent_id};")
        return self.acknowledged(number)

    def acknowledged(self, number: int) -> int:
        name = f"read/{number}"
        if not self._records.store.check([name]):
            return 0
        text = self._records.store.get(name)[:MAX_VALUE].decode("ascii", errors="replace")
        ids = {agent for agent in text.split(";") if agent and len(agent) <= MAX_AGENT_ID and agent.isprintable()}
        return len(ids)


class LocalBoard:
    """A board of this agent's own entries, when the rendezvous has no TCP store."""

    shared = False

    def __init__(self) -> None:
        self._entries: list[Entry] = []
        self._seen = 0

    def post(self, entry: Entry) -> int:
        self._entries.append(fitted(entry))
        return len(self._entries)

    def read_new(self) -> list[tuple[int, Entry]]:
        found = [(n + 1, e) for n, e in enumerate(self._entries[self._seen:], start=self._seen)][:MAX_PER_READ]
        self._seen += len(found)
        return found

    def claim(self, number: int | str) -> bool:
        return True

    def acknowledge(self, number: int) -> int:
        return 1

    def acknowledged(self, number: int) -> int:
        return 1
