"""The rendezvous state as it lies in the store: signed with the job's secret, or torch's bare pickle.

With a secret (the job's: elastic._shared.storage.job_secret) a state is stored as

    torchrevive-rdzv-signed/2 LAUNCH SEQ NONCE TAG\\n<torch's pickle>

LAUNCH is the launch's id (32 hex digits: elastic._shared.protocol.round_identity), SEQ counts the
launch's writes (each writer stores one more than the state it replaces), NONCE is 32 random hex
digits, TAG the Poly1305 tag (32 hex digits) under the one-time key
`PeerKey.body_tag(NONCE, "rendezvous-state RUN LAUNCH SEQ")` over the pickle: the same primitive as
snapshot bodies, under a `what` of its own and a fresh nonce for every write, so no snapshot tag is
ever a state's. Without a secret (an unsigned job, asked for explicitly) a state is torch's bare
pickle, as torch writes it.

Invariants:
- `open` returns a payload only after its tag verified (with a secret) and
  `state_pickle.check_state` accepted it: nothing else reaches torch.
- A state signed for another run id, launch or SEQ fails its tag.
- With a secret, an unsigned state is refused; without one, a signed state is
  refused too (this agent cannot check it): either way `StateRefused` says which
  setting the agents disagree on. A value in the store is never a reason to stop.
"""

from __future__ import annotations

import secrets

from dataclasses import dataclass

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from elastic._agent.rendezvous.state_pickle import StateRefused, check_state
from elastic._shared.protocol.round_identity import is_launch
from elastic._shared.storage import peer_auth
from elastic._shared.storage.peer_auth import PeerKey

MAGIC = b"torchrevive-rdzv-signed/2"
MAX_HEADER = 160
"""Bytes of the first line of a signed state, at most (the magic, the launch, a number and two tags)."""
MAX_SEQ = 1 << 62


def _what(run_id: str, launch: str, seq: int) -> str:
    return f"rendezvous-state {run_id} {launch} {seq}"


@dataclass(frozen=True)
class Opened:
    """A stored state that verified: its launch (None unsigned), write number (0 unsigned), torch's
    pickle and what it holds (read by the restricted unpickler)."""

    launch: str | None
    seq: int
    payload: bytes
    state: _RendezvousState


class StateSeal:
    """How one agent of run `run_id` writes and reads the state: signed with `key`, or bare when None."""

    def __init__(self, run_id: str, key: PeerKey | None) -> None:
        self.run_id = run_id
        self.signed = key is not None
        self._key = key

    def store_key(self) -> str:
        """Where the run's state lies in a c10d store. Unsigned: torch's own key, `torch.rendezvous.<run id>`.
        Signed: a key the secret names, `torchrevive.rdzv.<run id>.state.<16 hex digits>`, which a stranger
        who reaches the store cannot name (a TCPStore lists no keys): what it writes at torch's key is never
        read, and it cannot overwrite the job's state. (Refusing its forgeries was not enough: a stranger
        writing torch's key every 0.2 s left the agents of a 2:2 job reading the forgery far more often than
        each other's writes; each went on from its own last state, never saw the other join, and both timed
        out.) The key is the same for every launch of the run: a stranger who recorded an earlier launch's
        traffic knows it, and what it writes there is refused as before (`open`, state_guard)."""
        if self._key is None:
            return f"torch.rendezvous.{self.run_id}"
        return f"torchrevive.rdzv.{self.run_id}.state.{self._key.key_name(f'rendezvous-state {self.run_id}')}"

    def shadow_key(self, launch: str) -> str:
        """Where the latest state of launch `launch` is copied (state_shadow): a key the secret and the
        launch id name, which a recording of another launch cannot give. Signed runs only."""
        assert self._key is not None, "an unsigned run keeps no shadow"
        name = self._key.key_name(f"rendezvous-shadow {self.run_id} {launch}")
        return f"torchrevive.rdzv.{self.run_id}.shadow.{name}"

    def seal(self, payload: bytes, seq: int, launch: str) -> bytes:
        """What to store for torch's pickle `payload`, write number `seq` of launch `launch`."""
        if self._key is None:
            return payload
        nonce = secrets.token_hex(16)
        mac = self._key.body_tag(nonce, _what(self.run_id, launch, seq))
        mac.update(payload)
        return b"%s %s %d %s %s\n" % (MAGIC, launch.encode(), seq, nonce.encode(), mac.finalize().hex().encode()) + payload

    def open(self, blob: bytes) -> Opened:
        """A stored state that verified and passed `check_state`; `StateRefused` otherwise."""
        if not blob:
            raise StateRefused("it is empty or not base64")
        is_signed = blob.startswith(MAGIC + b" ")
        if self._key is None:
            if is_signed:
                raise StateRefused("it is signed with a secret and this agent has none (its job signs its "
                                   f"rendezvous: give this agent the job's {peer_auth.SECRET_FILE_ENV})")
            return Opened(None, 0, blob, check_state(blob))
        if not is_signed:
            raise StateRefused("it is not signed with the job's secret (an agent without "
                               f"{peer_auth.SECRET_FILE_ENV}, or someone else)")
        launch, seq, payload = self._verified(blob)
        return Opened(launch, seq, payload, check_state(payload))

    def _verified(self, blob: bytes) -> tuple[str, int, bytes]:
        assert self._key is not None
        header, newline, payload = blob[:MAX_HEADER].partition(b"\n")
        fields = header.split(b" ")
        if not newline or len(fields) != 5:
            raise StateRefused("its signature line is malformed")
        _, launch, seq_text, nonce, tag = fields
        if not (seq_text.isdigit() and len(seq_text) <= 19 and len(nonce) == 32 and len(tag) == 32
                and _is_hex(nonce) and _is_hex(tag) and is_launch(launch.decode("ascii", "replace"))):
            raise StateRefused("its signature line is malformed")
        seq = int(seq_text)
        if seq >= MAX_SEQ:
            raise StateRefused("its signature line is malformed")
        payload = blob[len(header) + 1:]
        mac = self._key.body_tag(nonce.decode(), _what(self.run_id, launch.decode(), seq))
        mac.update(payload)
        if not peer_auth.check_tag(mac, bytes.fromhex(tag.decode())):
            raise StateRefused("its signature does not verify with this job's secret (another job, or forged)")
        return launch.decode(), seq, payload


def _is_hex(text: bytes) -> bool:
    return all(c in b"0123456789abcdef" for c in text)
