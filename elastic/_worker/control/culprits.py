"""Which rank a stalled job waits for, named from the ranks' own records of their collectives. Pure: no I/O.

Every rank keeps a record of the collectives it entered (elastic._worker.control.collective_record):
a sequence number that grows by one per collective, the same on every rank for the same collective
(the ranks take the same collectives in the same order: a training step's gradient all-reduce, the
step vote), the operation and step of the newest one, and whether it has left it. When a rank's
training stalls, the ranks that can still talk publish their records (`RankRecord`, one bounded JSON
line each) and `name_culprits` reads them:

- the collective the job waits in is the newest one an answering rank is inside (entered, not left);
- a rank whose newest collective is older never entered it: a culprit (blocked in Python, a
  deadlock, a loader that never returns);
- a rank that did not answer (its thread cannot run: SIGSTOP, a frozen host, native code that holds
  the interpreter) is a culprit too; with a rank that answered and is behind, both are named (the
  silent one may be waiting for it); where a silent rank runs comes from what each rank said of
  itself when it started (`whereabouts`);
- when every rank answered and all wait inside the same collective, none is behind: no culprit
  (a network fault, or a collective stuck below the runtime), and the verdict says so.

Invariants: `RankRecord.parse` accepts only a JSON object of the declared fields and types, within
`MAX_RECORD` characters and `MAX_TEXT` per text, with a rank below the world size; anything else is
None (counted as no answer). `name_culprits` depends only on its arguments, so every rank that reads
the same records names the same culprits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

MAX_RECORD = 2048
"""The longest record (characters of JSON) a rank publishes or reads."""
MAX_TEXT = 240
"""The longest text field (an operation, a stack top, a node or host name)."""
NO_ANSWER = "no answer (stopped, frozen, or in native code that holds the interpreter)"


@dataclass(frozen=True)
class RankRecord:
    """One rank's account of itself, at its stall."""

    rank: int
    seq: int
    """How many collectives this rank has entered (the newest one's sequence number; 0: none yet)."""
    op: str
    """The newest collective's operation ("train step", "step vote")."""
    step: int
    """The step the newest collective belongs to."""
    inside: bool
    """Entered the newest collective and not left it."""
    last_done: str
    """The newest collective this rank entered and left ("" for none), e.g. "step vote at step 20"."""
    stack_top: str
    """Where its main thread is: the innermost frame of its Python stack ("file:line in function")."""
    node: str
    host: str

    def dumps(self) -> str:
        values = {**asdict(self), **{name: _clip(getattr(self, name)) for name in _TEXTS}}
        return json.dumps(values, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str | bytes, *, world_size: int) -> RankRecord | None:
        """The record in `text`, checked (see the module docstring); None for anything else."""
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError:
                return None
        if len(text) > MAX_RECORD:
            return None
        try:
            raw = json.loads(text)
        except ValueError:
            return None
        if not isinstance(raw, dict) or set(raw) != _FIELDS:
            return None
        ints = ("rank", "seq", "step")
        if any(type(raw[name]) is not int for name in ints) or type(raw["inside"]) is not bool:
            return None
        if any(not isinstance(raw[name], str) or len(raw[name]) > MAX_TEXT for name in _TEXTS):
            return None
        if not 0 <= raw["rank"] < world_size or raw["seq"] < 0 or not -1 <= raw["step"] < 1 << 62:
            return None
        return cls(**raw)

    def doing(self) -> str:
        """What this rank's newest collective is, in words."""
        return _collective(self.op, self.step) if self.seq else "no collective yet"


_FIELDS = {"rank", "seq", "op", "step", "inside", "last_done", "stack_top", "node", "host"}
_TEXTS = ("op", "last_done", "stack_top", "node", "host")


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def _collective(op: str, step: int) -> str:
    return f"{op} at step {step}"


@dataclass(frozen=True)
class Culprit:
    rank: int
    why: str
    """"never entered it" or NO_ANSWER."""
    last_done: str
    stack_top: str
    node: str
    host: str


@dataclass(frozen=True)
class Verdict:
    """What the ranks that answered agree the job waits for."""

    collective: str
    """The collective the job waits in ("" when no answering rank is inside one)."""
    step: int
    culprits: tuple[Culprit, ...]
    answered: tuple[int, ...]
    since: float = 0.0
    """When the stall they were named for began (seconds since the epoch; 0: unknown): a culprit's agent
    leaves alone a worker that started after it (a replacement, not what the job waited for), and a worker
    of the culprit's node that failed since is this hang's incident, not a second one."""

    def culprits_ranks(self) -> list[int]:
        return [c.rank for c in self.culprits]

    def line(self) -> str:
        """One line for every agent's log."""
        if not self.culprits:
            where = self.collective or "no collective"
            return (f"hang: every rank answered and waits in {where}; none is behind, so no culprit is named "
                    "(a network fault, or a collective stuck below the runtime)")
        named = "; ".join(
            f"rank {c.rank} on node {c.node or '?'} (host {c.host or '?'}): {c.why}, last completed "
            f"{c.last_done or 'none'}, stack top {c.stack_top or 'unknown'}"
            for c in self.culprits
        )
        return f"hang: the job waits in {self.collective or 'a collective'} for {named}"

    def fields(self) -> dict[str, object]:
        """The `hang` event's fields."""
        return {
            "culprits": [c.rank for c in self.culprits],
            "nodes": [c.node for c in self.culprits],
            "hosts": [c.host for c in self.culprits],
            "collective": self.collective,
            "stack_tops": [c.stack_top for c in self.culprits],
            "last_done": [c.last_done for c in self.culprits],
            "reasons": [c.why for c in self.culprits],
            "answered": list(self.answered),
            **({"since": self.since} if self.since > 0 else {}),
        }


def name_culprits(
    records: Mapping[int, RankRecord | None], world_size: int,
    whereabouts: Mapping[int, tuple[str, str]] | None = None,
) -> Verdict:
    """The culprits of a stall, from each rank's record (None, or missing: that rank did not answer);
    `whereabouts`: each rank's (node, host), as it said at its start, for the ranks that did not answer."""
    known = whereabouts or {}
    answered = {rank: record for rank, record in records.items() if record is not None and 0 <= rank < world_size}
    silent = [rank for rank in range(world_size) if rank not in answered]
    waiting = [record for record in answered.values() if record.inside]
    front = max(waiting, key=lambda record: record.seq, default=None)
    if front is None:  # nobody that answered is inside a collective: the newest any of them entered
        front = max(answered.values(), key=lambda record: record.seq, default=None)
    behind = [record for record in answered.values() if front is not None and record.seq < front.seq]
    culprits = [
        Culprit(r.rank, f"never entered it (its newest: {r.doing()})", r.last_done, r.stack_top, r.node, r.host)
        for r in sorted(behind, key=lambda record: record.rank)
    ]
    culprits += [Culprit(rank, NO_ANSWER, "", "", *known.get(rank, ("", ""))) for rank in silent]
    return Verdict(
        collective=_collective(front.op, front.step) if front is not None and front.seq else "",
        step=front.step if front is not None else -1,
        culprits=tuple(culprits),
        answered=tuple(sorted(answered)),
    )
