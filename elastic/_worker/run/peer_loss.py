"""A worker whose peer died: one line that says so, not a traceback and not a preemption.

Under `--survivors restart` (the default), a worker's death ends its whole group: torchrun stops the
others (SIGTERM, then SIGKILL) and starts a new round from the newest snapshot or checkpoint. A survivor
meets the death first as a collective that breaks from the other end (gloo: "Connection closed by
peer"), in the middle of its step. That is the peer's failure, not this worker's: leaving the run with
such an error, it raises `PeerLost` instead, whose one line names the step and the broken collective,
and whose exit status (`PEER_LOST_EXIT`) its agent never counts as a primary failure (primary failures
set a node aside and make crash loops: a healthy node must never collect them).

Invariants:
- Only a `RuntimeError` whose text reads as a peer's death (`reads_as_peer_loss`) becomes `PeerLost`;
  every other error leaves as it came.
- Under `--survivors keep` or `train-on` a peer's death is healed in place (elastic._worker.survivors):
  an error that still reaches the end of the run there is not translated (the heal did not hold).
"""

from __future__ import annotations

from elastic._shared.common.errors import PeerLost, first_line
from elastic._shared.protocol.exit_status import reads_as_peer_loss


def as_peer_loss(error: BaseException | None, *, rank: int, step: int) -> PeerLost | None:
    """`error` as `PeerLost` when it is a collective broken by a peer's death (see the module docstring)."""
    if not isinstance(error, RuntimeError) or not reads_as_peer_loss(str(error)):
        return None
    return PeerLost(
        f"rank {rank} stops: a peer worker died during step {step + 1} (its collective broke: "
        f"{first_line(error)[:200]}); the job restarts every worker from its newest snapshot or checkpoint"
    )


def raise_if_peer_lost(error: BaseException | None, *, rank: int, step: int, heals: bool) -> None:
    """Raise `PeerLost` in place of `error` (the run is already left) when it is a peer's death and the
    job restarts its workers for it (`heals`: under keep or train-on it does not)."""
    lost = None if heals else as_peer_loss(error, rank=rank, step=step)
    if lost is not None:
        raise lost from None
