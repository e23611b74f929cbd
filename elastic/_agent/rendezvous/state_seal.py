"""The rendezvous state as it lies in the store: signed with the job's secret, or torch's bare pickle.

With a secret (TORCHREVIVE_SNAPSHOT_SECRET_FILE or TORCHREVIVE_SNAPSHOT_SECRET,
the one snapshot traffic is signed with: `peer_auth.PeerKey`) a state is stored as

    torchrevive-rdzv-signed/1 SEQ NONCE TAG\\n<torch's pickle>

SEQ counts the writes of the run (each writer stores one more than the state it
replaces), NONCE is 32 random hex digits, TAG the Poly1305 tag (32 hex digits)
under the one-time key `PeerKey.body_tag(NONCE, "rendezvous-state RUN SEQ")`
over the pickle: the same primitive as snapshot bodies, under a `what` of its own
and a fresh nonce for every write, so no snapshot tag is ever a state's.
Without a secret a state is torch's bare pickle, as torch writes it.

Invariants:
- `open` returns a payload only after its tag verified (with a secret) and
  `state_pickle.check_state` accepted it: nothing else reaches torch.
- A state signed for another run id, or with another SEQ, fails its tag.
- With a secret, an unsigned state is refused; without one, a signed state is
  refused (this agent cannot check it): either way `StateRefused` says which
  setting the agents disagree on.
"""

from __future__ import annotations

import secrets

from elastic._agent.rendezvous.state_pickle import StateRefused, check_state
from elastic._shared.common.errors import UsageError
from elastic._shared.storage import peer_auth
from elastic._shared.storage.peer_auth import PeerKey


class SecretMissing(UsageError):
    """A signed state met by an agent without the job's secret: one line, exit 2 (not a state to refuse)."""


MAGIC = b"torchrevive-rdzv-signed/1"
MAX_HEADER = 128
"""Bytes of the first line of a signed state, at most (the magic, a number and two tags)."""
MAX_SEQ = 1 << 62


def _what(run_id: str, seq: int) -> str:
    return f"rendezvous-state {run_id} {seq}"


class StateSeal:
    """How one agent of run `run_id` writes and reads the state: signed with `key`, or bare when None."""

    def __init__(self, run_id: str, key: PeerKey | None) -> None:
        self.run_id = run_id
        self.signed = key is not None
        self._key = key

    def seal(self, payload: bytes, seq: int) -> bytes:
        """What to store for torch's pickle `payload`, the run's write number `seq`."""
        if self._key is None:
            return payload
        nonce = secrets.token_hex(16)
        mac = self._key.body_tag(nonce, _what(self.run_id, seq))
        mac.update(payload)
        return b"%s %d %s %s\n" % (MAGIC, seq, nonce.encode(), mac.finalize().hex().encode()) + payload

    def open(self, blob: bytes) -> tuple[int, bytes]:
        """(SEQ, torch's pickle) of a stored state that verified and passed `check_state` (SEQ is 0
        without a secret); `StateRefused` otherwise."""
        if not blob:
            raise StateRefused("it is empty or not base64")
        is_signed = blob.startswith(MAGIC + b" ")
        if self._key is None:
            if is_signed:
                # Not a stranger's to write over: the job's own agents sign. Going on from a fresh state
                # would start a second job beside it on the same run id; this agent stops instead.
                raise SecretMissing(f"the rendezvous state of run {self.run_id} is signed with the job's secret and "
                                    f"this agent has none: give it the job's {peer_auth.SECRET_FILE_ENV}")
            check_state(blob)
            return 0, blob
        if not is_signed:
            raise StateRefused("it is not signed with the job's secret (an agent without "
                               f"{peer_auth.SECRET_FILE_ENV}, or someone else)")
        seq, payload = self._verified(blob)
        check_state(payload)
        return seq, payload

    def _verified(self, blob: bytes) -> tuple[int, bytes]:
        assert self._key is not None
        header, newline, payload = blob[:MAX_HEADER].partition(b"\n")
        fields = header.split(b" ")
        if not newline or len(fields) != 4:
            raise StateRefused("its signature line is malformed")
        _, seq_text, nonce, tag = fields
        if not (seq_text.isdigit() and len(seq_text) <= 19 and len(nonce) == 32 and len(tag) == 32
                and _is_hex(nonce) and _is_hex(tag)):
            raise StateRefused("its signature line is malformed")
        seq = int(seq_text)
        if seq >= MAX_SEQ:
            raise StateRefused("its signature line is malformed")
        payload = blob[len(header) + 1:]
        mac = self._key.body_tag(nonce.decode(), _what(self.run_id, seq))
        mac.update(payload)
        if not peer_auth.check_tag(mac, bytes.fromhex(tag.decode())):
            raise StateRefused("its signature does not verify with this job's secret (another job, or forged)")
        return seq, payload


def _is_hex(text: bytes) -> bool:
    return all(c in b"0123456789abcdef" for c in text)
