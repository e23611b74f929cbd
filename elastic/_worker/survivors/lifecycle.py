"""One worker's place in the survivors' groups, as an explicit state machine.

    STARTING --arm--> MEMBER                                   (a member of the round's first group)
    STARTING --------> CATCHING_UP                             (a keep replacement: its group formed at start)
    STARTING --------> AWAITING                                (a train-on replacement: it waits to be admitted)
    MEMBER --a step's gradient all-reduce failed--> VOID --> LEAVING
    MEMBER --its bookkeeping failed, or a grow--> LEAVING
    LEAVING --> AWAITING --> FORMING --> CATCHING_UP --> MEMBER
    LEAVING --> FORMING                                        (a grow: the next view is known)
    FORMING --a member did not come--> AWAITING                (the next view, or the next generation)
    FORMING, CATCHING_UP --the new group broke--> LEAVING      (and round again, at most `ATTEMPTS` times)
    any --> LEFT                                               (a new round takes over: RegroupError, a stop)

AWAITING is where the two policies differ: with `keep` a worker awaits its agent's heal (the dead
worker's replacement, the next generation's group at the same ranks); with `train-on` it awaits
the next view of whoever arrived (a smaller group at once), and a replacement awaits a grow.

Invariants:
- A move not in `TRANSITIONS` is a bug of the caller: `IllegalMove` (an AssertionError, never a
  RuntimeError: nothing that heals a broken collective may swallow it).
- `history` holds every phase since the last MEMBER (a heal's path: the `heal` event reports it).
"""

from __future__ import annotations

import enum
import logging

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"
    """Before `Run.start` armed the worker: not a healer yet."""
    MEMBER = "member"
    """In a formed group with the newest state: training."""
    VOID = "void"
    """The step being trained failed in its gradient all-reduce; what it changed is undone."""
    LEAVING = "leaving"
    """Letting go of the broken group (and DDP's hold on it), the group's parts dropped."""
    AWAITING = "awaiting"
    """Waiting for the next group: the agent's heal (keep), the next view (train-on), an admission."""
    FORMING = "forming"
    """Forming the next group with its members."""
    CATCHING_UP = "catching up"
    """Agreeing on the newest state and taking it from the member that holds it."""
    LEFT = "left"
    """Gone from the survivors: a new round (or the job's end) takes over."""


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.MEMBER, Phase.CATCHING_UP, Phase.AWAITING}),
    Phase.MEMBER: frozenset({Phase.VOID, Phase.LEAVING}),
    Phase.VOID: frozenset({Phase.LEAVING}),
    Phase.LEAVING: frozenset({Phase.AWAITING, Phase.FORMING}),
    Phase.AWAITING: frozenset({Phase.FORMING}),
    Phase.FORMING: frozenset({Phase.CATCHING_UP, Phase.AWAITING, Phase.LEAVING}),
    Phase.CATCHING_UP: frozenset({Phase.MEMBER, Phase.LEAVING}),
    Phase.LEFT: frozenset(),
}
"""Every allowed move; any phase may also move to LEFT."""


class IllegalMove(AssertionError):
    """A move the lifecycle does not allow (a bug of the caller, never a fault of the world)."""


class Lifecycle:
    """One worker's phase (see the module docstring)."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.history: list[Phase] = [Phase.STARTING]

    def move(self, to: Phase) -> None:
        if to is not Phase.LEFT and to not in TRANSITIONS[self.phase]:
            raise IllegalMove(f"the survivors' lifecycle cannot go from {self.phase.value} to {to.value}")
        logger.debug("survivors: %s -> %s", self.phase.value, to.value)
        # A change begins where a member leaves its group: the history starts over there.
        self.history = [self.phase, to] if self.phase is Phase.MEMBER else [*self.history, to]
        self.phase = to

    def path(self) -> list[str]:
        """The phases of the last change, from the MEMBER (or STARTING) it began at."""
        return [phase.value for phase in self.history]
