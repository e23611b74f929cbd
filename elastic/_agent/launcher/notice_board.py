"""The job's notice board: what one agent learns of a failure, every agent reads, in the same order.

An entry is one JSON object: `kind` (`KINDS`: a worker's `failure`, a named `hang`, a node set aside,
`node_excluded`, a `crash_loop` that stops the job), the `line` every agent prints, the `time`, the
`step` and `world_size` it happened at, and the event's `fields`. Entries are numbered by the store's
counter (`count`), so every agent reads them in the same order.

Where: the rendezvous store (a TCPStore under c10d), keys under `torchrevive/notices/RUN/`, each value
sealed with the job's secret (elastic._shared.storage.store_records) and read back checked. Without a
TCP store (an etcd rendezvous) the board is this agent's own (`LocalBoard`): it sees its own node's
entries only, and says so once.

Invariants: an entry is at most `store_records.MAX_VALUE` characters of ASCII JSON; `read_new` reads at
most `MAX_PER_READ` entries per call, only ones whose key is there (`check` before `get`: no call waits
on a key a poster has not written yet: it is read at the next call), and returns only entries that
parse (`Entry.parse`); one that does not is skipped with one warning, never retried.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.store_records import MAX_VALUE, Records, strict_count

logger = logging.getLogger(__name__)

KINDS = ("failure", "hang", "node_excluded", "crash_loop")
MAX_PER_READ = 64
MAX_LINE = 1500
MAX_ENTRIES = 1 << 20


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

    def __init__(self, store: Any, run_id: str, environ: Any = None) -> None:
        import torch.distributed as dist

        scope = f"torchrevive/notices/{run_id}/"
        try:
            key = PeerKey.from_env(os.environ if environ is None else environ)
        except SecretError as error:
            logger.warning("the job's notices go unsealed: %s", error)
            key = None
        self._records = Records(dist.PrefixStore(scope, store), key=key, scope=scope)
        self._seen = 0

    def post(self, entry: Entry) -> int:
        """Add `entry`; its number."""
        entry = fitted(entry)
        number = int(self._records.store.add("count", 1))
        self._records.set(f"n{number}", entry.dumps())
        return number

    def read_new(self) -> list[tuple[int, Entry]]:
        """The entries after the last one read (at most MAX_PER_READ), in order."""
        count = strict_count(str(self._records.store.add("count", 0)), most=MAX_ENTRIES) or 0
        found: list[tuple[int, Entry]] = []
        while self._seen < count and len(found) < MAX_PER_READ:
            number = self._seen + 1
            if not self._records.store.check([f"n{number}"]):
                break  # posted, not yet written: read at the next call
            self._seen = number
            text = self._records.get(f"n{number}")
            entry = Entry.parse(text) if text is not None else None
            if entry is None:
                self._records.warn_once(f"n{number}", "is not a notice")
                continue
            found.append((number, entry))
        return found

    def claim(self, number: int | str) -> bool:
        """Whether this agent is the first to claim `number` (an entry, to write it to the event log; or a
        name: the one decision of the job the first to claim it posts)."""
        return int(self._records.store.add(f"written{number}", 1)) == 1

    def acknowledge(self, number: int) -> int:
        """Say this agent has read entry `number` (a stop); how many agents have said so."""
        return strict_count(str(self._records.store.add(f"read{number}", 1)), most=MAX_ENTRIES) or 0

    def acknowledged(self, number: int) -> int:
        return strict_count(str(self._records.store.add(f"read{number}", 0)), most=MAX_ENTRIES) or 0


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
