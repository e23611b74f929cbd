"""Which launch and round a value in a store belongs to: the scopes `SealedStore` binds values to.

A launch is one start of a job's agents under a run id; the same run id and secret are used again
when a job resumes, so every seal names the launch too. Its id (`LAUNCH_HEX` hex digits) is drawn by
the agent that writes the first rendezvous state of the launch and fixed, in every agent, by the
first state it verifies (elastic._agent.rendezvous.state_guard). A round is torch's rendezvous
round number, read from that verified state.

The agents' store (the rendezvous store torch's agent uses) is sealed in `rendezvous_scope(run,
launch)`: its keys already name the round where torch's do. A worker store (a process group's
bootstrap, fresh each round, or torchrun's shared one whose keys do not name the round) is sealed in
`worker_scope(run, identity)`.

Each agent tells its workers the round they start in (`publish`): in `ROUND_ENV` of its own
environment (workers started fresh inherit it) and in a note in the agent's private notes directory
(`worker_notes.NOTES_ENV`: workers forked from a fork server started before the first round read
it there). A worker reads it once when it joins its group (`read`): the note first, then the
environment.

Invariants: a scope names its run id last, after fields of fixed form (a literal, hex digits,
digits), so no two (run, launch, round) triples share a scope; what `read` returns is checked
(`LAUNCH_HEX` lowercase hex digits, a round from 0 to 2**62) or None.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from elastic._shared.protocol import worker_notes

ROUND_ENV = "TORCHREVIVE_ROUND"
"""Set by the agent for its workers: "LAUNCH ROUND"."""
LAUNCH_HEX = 32
MAX_ROUND = 1 << 62
ROUND_NOTE = "round"


def new_launch() -> str:
    return secrets.token_hex(LAUNCH_HEX // 2)


def is_launch(text: str) -> bool:
    return len(text) == LAUNCH_HEX and all(c in "0123456789abcdef" for c in text)


def rendezvous_scope(run_id: str, launch: str) -> str:
    """The scope of the agents' store of `launch` of run `run_id`."""
    return f"rendezvous\n{launch}\n{run_id}"


def changes_scope(run_id: str) -> str:
    """The scope of the rendezvous' change counter (quick_rounds.ChangeSignal), which every launch of
    the run shares: it is read before a launch is known, and a stale value only wakes a waiter early."""
    return f"rendezvous-changes\n{run_id}"


@dataclass(frozen=True)
class RoundIdentity:
    launch: str
    round: int

    def text(self) -> str:
        return f"{self.launch} {self.round}"

    @classmethod
    def parse(cls, text: str | None) -> RoundIdentity | None:
        launch, _, number = (text or "").strip().partition(" ")
        if not (is_launch(launch) and number.isascii() and number.isdigit() and len(number) <= 19):
            return None
        value = int(number)
        return cls(launch, value) if value < MAX_ROUND else None


def worker_scope(run_id: str, identity: RoundIdentity) -> str:
    """The scope of the worker store of `identity`'s round of run `run_id`."""
    return f"workers\n{identity.launch}\n{identity.round}\n{run_id}"


def note_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / ROUND_NOTE


def publish(identity: RoundIdentity, environ: MutableMapping[str, str]) -> None:
    """Tell this agent's workers (started from now on) the round they are in."""
    env = environ
    env[ROUND_ENV] = identity.text()
    notes = env.get(worker_notes.NOTES_ENV)
    if notes:
        worker_notes.write_json(note_path(notes), {"round": identity.text()})


def read(environ: Mapping[str, str]) -> RoundIdentity | None:
    """The round this worker's agent started it in (see the module docstring); None when it said none."""
    env = environ
    notes = env.get(worker_notes.NOTES_ENV)
    if notes:
        noted = worker_notes.read_json(note_path(notes))
        text = noted.get("round") if noted else None
        if isinstance(text, str):
            return RoundIdentity.parse(text)
    return RoundIdentity.parse(env.get(ROUND_ENV))
