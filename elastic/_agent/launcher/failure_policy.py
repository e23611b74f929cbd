"""What the agents decide from the job's failures: set a bad node aside, stop a crash loop. Pure: no I/O.

Every agent reads the same list of the job's failures and named hangs (elastic._agent.launcher.job_watch),
so each comes to the same decision about its own node:

- A **strike** against a node is a worker of it that failed first (a primary failure: not a peer's
  collateral, `is_collateral`) or that a hang verdict named (`NamedHang`), one per incident: a hang whose
  culprit's node had a worker fail while the stall lasted (a frozen worker its agent ended before the
  verdict came) is that failure, not a second strike. A node with `limit` strikes within
  `window` seconds while every other node has fewer (below `limit`, and below its count) is bad: it is
  **set aside**, if the job can train without it (more nodes than --nnodes MIN). A failure that comes
  once, or that strikes several nodes alike, sets no one aside.
- A worker that exits with `FAULTY_NODE_EXIT` proved its own node wrong (its parameters diverged from
  its replicas again after every rank rolled back and replayed: elastic._worker.integrity): that one
  failure is `limit` strikes, so its node is set aside at once where the job can shrink. So is a worker
  that exits with `EVICTED_EXIT`: every rank agreed it is a straggler past --evict-factor
  (elastic._worker.observe.eviction), and its node leaves so the job trains on without it.
- A **crash loop** is a failure that repeats at the same step, with no step completed past it in
  between: the last `attempts` primary failures of the job all died after the same completed step, or
  all before a first step with the same error (a script that fails at its start: with `--max-restarts`
  large by default, it would otherwise start again and again).
  Restarting again would meet it again: the job stops with `CRASH_LOOP_EXIT`. Setting aside is decided
  first: a loop that only one node has, in a job that can shrink, is that node's, and the job tries
  on without it (a batch that crashes every node then loops on the next node, and stops).

Invariants: `decide` depends only on its arguments; a failure before a first step (-1) counts towards a
loop only with an exit status and an error the others share (a kill there never counts); `limit` or
`attempts` of 0 turns its rule off.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass

from elastic._agent.timings import SAME_INCIDENT_SLACK
from elastic._shared.protocol.exit_status import EVICTED_EXIT, FAULTY_NODE_EXIT, PEER_LOST_EXIT, reads_as_peer_loss

CRASH_LOOP_EXIT = 78
"""The job stopped because a failure repeats at the same step (distinct from 1, 2, 75, 76, 124, 143)."""
SET_ASIDE_EXIT = 79
"""This node's agent left the job: its workers failed too often while the rest stayed healthy."""

SET_ASIDE_FAILURES_ENV = "TORCHREVIVE_SET_ASIDE_FAILURES"
SET_ASIDE_WINDOW_ENV = "TORCHREVIVE_SET_ASIDE_WINDOW"
SET_ASIDE_COOL_OFF_ENV = "TORCHREVIVE_SET_ASIDE_COOL_OFF"
CRASH_LOOP_ATTEMPTS_ENV = "TORCHREVIVE_CRASH_LOOP_ATTEMPTS"
DEFAULTS = {SET_ASIDE_FAILURES_ENV: "3", SET_ASIDE_WINDOW_ENV: "600", SET_ASIDE_COOL_OFF_ENV: "1800",
            CRASH_LOOP_ATTEMPTS_ENV: "3"}
"""The settings' defaults (elastic._agent.launcher.settings is their one source: flags, variables, help)."""

MAX_TEXT = 300
_COLLATERAL_EXITS = frozenset({124, 76, 143, -15, PEER_LOST_EXIT})
"""The hang watchdog (every rank of a stuck group trips; the hang verdict names the culprit), a heal in
place whose peers never came, SIGTERM (the agent stopping its group), and a worker that stopped because
a peer's death broke its collective (it said so: `PEER_LOST_EXIT`)."""


@dataclass(frozen=True)
class Failure:
    """One worker's failure, as its node's agent saw it."""

    rank: int
    node: str
    host: str
    exitcode: int
    """The exit status, or minus the signal that killed it."""
    step: int
    """The last step it completed (-1: unknown)."""
    error: str
    """The first line of its exception, or how it ended."""
    time: float
    primary: bool
    """Not a peer's collateral (`is_collateral`)."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def parse(cls, raw: object) -> Failure | None:
        """A failure as the board carries it, checked; None for anything else."""
        if not isinstance(raw, dict) or set(raw) != set(cls.__dataclass_fields__):
            return None
        ints, texts = ("rank", "exitcode", "step"), ("node", "host", "error")
        if any(type(raw[k]) is not int or abs(raw[k]) >= 1 << 62 for k in ints):
            return None
        if any(not isinstance(raw[k], str) or len(raw[k]) > MAX_TEXT for k in texts):
            return None
        if not isinstance(raw["time"], (int, float)) or isinstance(raw["time"], bool) or not math.isfinite(raw["time"]):
            return None
        if type(raw["primary"]) is not bool or raw["rank"] < 0 or raw["step"] < -1:
            return None
        return cls(**raw)


@dataclass(frozen=True)
class NamedHang:
    """A node a hang verdict named, as the job's board holds it."""

    node: str
    time: float
    """When the verdict was posted."""
    since: float = 0.0
    """When the stall it names began (0: unknown)."""


@dataclass(frozen=True)
class Strike:
    """A mark against a node: a primary failure of its worker, or a hang that named it."""

    node: str
    time: float
    what: str
    """"failure" or "hang"."""


def is_collateral(exitcode: int, error: str) -> bool:
    """Whether a worker's failure reads as a peer's: a broken collective, the watchdog of a stuck group,
    the agent's own stop."""
    return exitcode in _COLLATERAL_EXITS or reads_as_peer_loss(error)


def how_it_ended(exitcode: int) -> str:
    """"killed by SIGKILL", "exit status 1"."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def first_line(text: str) -> str:
    """The first non-empty line of `text`, at most `MAX_TEXT` characters, printable."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    line = "".join(ch if ch.isprintable() else "?" for ch in line)
    return line if len(line) <= MAX_TEXT else line[: MAX_TEXT - 3] + "..."


@dataclass(frozen=True)
class Decision:
    kind: str
    """"restart" (as torch would), "set_aside" (`node` leaves the job) or "stop" (a crash loop)."""
    line: str = ""
    strikes: int = 0
    failure: Failure | None = None
    node: str = ""
    """The node set aside."""


RESTART = Decision("restart")
_AT_ONCE = frozenset({FAULTY_NODE_EXIT, EVICTED_EXIT})
"""Exit statuses that set their node aside at the first failure (where the job can shrink)."""


def strikes_of(failures: Sequence[Failure], hangs: Sequence[NamedHang], *, limit: int = 1) -> list[Strike]:
    """The strikes in the job's failures and named hangs, one per incident (see the module docstring); a
    failure with `FAULTY_NODE_EXIT` (a node proven wrong) or `EVICTED_EXIT` (a straggler the ranks evicted)
    is `limit` of them."""
    primaries = [f for f in failures if f.primary]
    marks = [Strike(f.node, f.time, "failure") for f in primaries
             for _ in range(max(1, limit) if f.exitcode in _AT_ONCE else 1)]
    marks += [Strike(hang.node, hang.time, "hang") for hang in hangs
              if hang.node and not _failed_during(hang, primaries)]
    return sorted(marks, key=lambda strike: strike.time)


def _failed_during(hang: NamedHang, primaries: Sequence[Failure]) -> bool:
    """Whether a worker of the hang's node failed first while the stall it names lasted (its own incident)."""
    return hang.since > 0 and any(
        f.node == hang.node and hang.since <= f.time <= hang.time + SAME_INCIDENT_SLACK for f in primaries)


def bad_node(strikes: Sequence[Strike], node: str, now: float, *, limit: int, window: float) -> list[Strike] | None:
    """`node`'s strikes within the window, when they are `limit` or more while every other node has fewer
    than `limit` there and fewer than `node` (the rest of the job healthy: a one-off elsewhere does not
    shield a bad node, and failures that strike several nodes alike set none aside); else None."""
    if limit <= 0:
        return None
    recent = [s for s in strikes if now - window <= s.time <= now]
    mine = [s for s in recent if s.node == node]
    others: dict[str, int] = {}
    for strike in recent:
        if strike.node != node:
            others[strike.node] = others.get(strike.node, 0) + 1
    most_elsewhere = max(others.values(), default=0)
    if len(mine) < limit or most_elsewhere >= limit or most_elsewhere >= len(mine):
        return None
    return mine


def loop_key(failure: Failure) -> object | None:
    """What makes failures the same crash: the step they died after; before a first step (a script that fails
    at its start: an import, its data, its arguments), the same error with an exit status of its own. None for
    a failure that cannot count: a kill before a first step (nothing says it would come again)."""
    if failure.step >= 0:
        return failure.step
    if failure.exitcode > 0 and failure.exitcode not in _COLLATERAL_EXITS:
        return ("before its first step", failure.error)
    return None


def crash_loop(failures: Sequence[Failure], *, attempts: int) -> Failure | None:
    """The newest failure when the last `attempts` primary failures are the same crash (`loop_key`)."""
    if attempts <= 0:
        return None
    primaries = [f for f in failures if f.primary]
    if len(primaries) < attempts:
        return None
    keys = {loop_key(f) for f in primaries[-attempts:]}
    return primaries[-1] if len(keys) == 1 and None not in keys else None


def decide(
    failures: Sequence[Failure], hangs: Sequence[NamedHang], *, now: float, can_shrink: bool,
    limit: int, window: float, attempts: int, excluded: Collection[str] = (),
) -> Decision:
    """What the job does after its newest failure (see the module docstring); every agent that reads the
    same failures decides the same, and the agent of the node set aside acts on it. Failures and hangs
    of nodes already `excluded` count no more."""
    failures = [f for f in failures if f.node not in excluded]
    hangs = [hang for hang in hangs if hang.node not in excluded]
    strikes = strikes_of(failures, hangs, limit=limit)
    culprit = strikes[-1].node if strikes else None
    marks = bad_node(strikes, culprit, now, limit=limit, window=window) if can_shrink and culprit else None
    if marks is not None and culprit is not None:
        kinds = sorted({s.what + "s" for s in marks})
        if any(f.node == culprit and f.primary and f.exitcode == FAULTY_NODE_EXIT for f in failures):
            return Decision("set_aside", strikes=len(marks), node=culprit, line=(
                f"node {culprit} is set aside: its worker's parameters diverged from its replicas again after "
                "every rank rolled back and replayed (exit 80: it computes wrong); its agent leaves the job, "
                "which trains on without it"))
        if any(f.node == culprit and f.primary and f.exitcode == EVICTED_EXIT for f in failures):
            return Decision("set_aside", strikes=len(marks), node=culprit, line=(
                f"node {culprit} is set aside: its worker was evicted as a straggler (exit {EVICTED_EXIT}: "
                "--slow-ranks evict); its agent leaves the job, which trains on without it"))
        return Decision(
            "set_aside", strikes=len(marks), node=culprit,
            line=(f"node {culprit} is set aside: {len(marks)} {' and '.join(kinds)} of its workers within "
                  f"{window:g} s while the other nodes stayed healthy; its agent leaves the job, which trains "
                  "on without it"),
        )
    looping = crash_loop(failures, attempts=attempts)
    if looping is not None:
        return Decision(
            "stop", failure=looping,
            line=(f"crash loop: the job failed {attempts} times in a row "
                  + (f"after step {looping.step} with no step completed past it" if looping.step >= 0 else
                     "before its first step, the same way") +
                  f" (last: rank {looping.rank} on node {looping.node}: {looping.error}); "
                  f"stopping with exit status {CRASH_LOOP_EXIT} instead of restarting into it again"),
        )
    return RESTART


def dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))
