"""Exit statuses a worker ends with that its agent reads as a verdict, not as a crash.

Invariant: distinct from the statuses the rest of the runtime gives (1, 2, 75 storage, 76 a heal that
did not form, 78 a crash loop, 79 a node set aside, 81 the numeric guard, 124 the hang watchdog, 143 SIGTERM).
"""

from __future__ import annotations

from elastic._shared.common.errors import PeerLost

FAULTY_NODE_EXIT = 80
"""A worker whose parameters diverged from its replicas again after every rank rolled back to the last
passing replica check and replayed (elastic._worker.integrity.replica_check): its node computes wrong.
Its agent's failure policy sets the node aside at once (elastic._agent.launcher.failure_policy)."""

EVICTED_EXIT = 82
"""A worker evicted as a straggler (`--slow-ranks evict` under --survivors train-on): its work per sample
stayed --evict-factor times the others' median (elastic._worker.observe.eviction). Its agent's failure
policy sets its node aside at once, like `FAULTY_NODE_EXIT`, and the survivors train on without it."""

PEER_LOST_EXIT = PeerLost.exit_code
"""A worker whose collective broke because a peer died, under `--survivors restart` (`PeerLost`): the peer's
failure, not its own. Its agent never counts it as a primary failure (elastic._agent.launcher.failure_policy)."""

PEER_LOSS_MARKS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "timed out waiting",
    "socket timeout", "read error", "connection refused", "gloo", "nccl communicator was aborted",
)
"""How a collective's error reads when a peer died (it broke from the other end): gloo's and NCCL's words."""


def reads_as_peer_loss(text: str) -> bool:
    """Whether an error's text is a collective broken by a peer's death (`PEER_LOSS_MARKS`)."""
    lowered = text.lower()
    return any(mark in lowered for mark in PEER_LOSS_MARKS)
