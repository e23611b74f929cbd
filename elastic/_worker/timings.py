"""The worker side's clocks: every duration the layer waits, polls or gives up after is named here, so
that a reader sees the layer's clocks in one page.

Each module that uses one imports it under its old name (tests patch it there); this module imports
nothing from elastic, and tests/unit/test_timings.py keeps every such constant here, each with its reason.
"""

from __future__ import annotations

from datetime import timedelta

# --- runtime: the process group and the round's store -----------------------------------------------

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""`init_worker`'s bound on a collective with a dead peer: the 300 s default of --collective-timeout."""
ERROR_TEARDOWN_DEADLINE = timedelta(seconds=5)
"""How long a failed worker gives its process group's teardown before leaving it to process
exit: well under torchrun's 30 s between SIGTERM and SIGKILL, so it never delays a recovery by that."""
LISTENER_WAIT_S = 10.0
"""The longest a rank waits for rank 0's store server to listen (capped by the timeout) before torch's own
client takes over: a restart's rank 0 listens within seconds."""
LISTENER_POLL_S = 0.005
"""Between connects to that server: a bare connect costs it nothing, torch's own retry waits about 0.5 s."""
ROUND_POLL_FIRST_S = 0.002
"""Rank 0's pause between answering hellos right after one came: the ranks of a round join within milliseconds."""
ROUND_POLL_MAX_S = 0.05
"""That pause grows by half while no rank joins, up to this: an idle wait is 20 reads a second."""

# --- observe: the event log ---------------------------------------------------------------------------

FLUSH_SECONDS = 0.05
"""A watcher of the log (a test waiting for a step) sees it at most this late."""

# --- control: the step vote and preemption ------------------------------------------------------------

VOTE_SECONDS = 1.0
"""The steps between votes take about this long: a signal is learned within about twice this, at one small
collective a second."""
DEFAULT_GRACE_SECONDS = 15.0
"""After SIGTERM, the time to reach the agreed step and checkpoint (--term-grace's default): half of the 30 s
torchrun's agent allows before SIGKILL."""

# --- survivors: views, heals in place, joiners --------------------------------------------------------

SETTLE_SECONDS = 2.0
"""How long a survivor waits for members of the last view that neither arrived nor were marked failed:
survivors arrive as soon as their collective fails (before they tear anything down), within milliseconds
of each other on an idle machine; a dead worker's agent marks it within its monitor interval (0.5 s);
a lost node's workers are never marked, so a lost node costs this wait."""
GATHER_SECONDS = 10.0
"""How long the members of a closed view wait for each other before they give it up and shrink."""
MARK_CHECK_SECONDS = 0.25
"""How often a member waiting for a view to form reads failure marks (an agent marks a dead worker within its
monitor interval, 0.5 s: reading them at every poll would double the members' reads)."""
VIEW_POLL_S = 0.005
"""A view's wait polls first after this (views' `_POLL_S`): the members of a view arrive within milliseconds."""
VIEW_MAX_POLL_S = 0.05
"""Waits poll from VIEW_POLL_S, doubling up to this: a wait of seconds is a few dozen reads."""
REGROUP_POLL_S = 0.005
"""Between reads of the heal count while an agent starts the replacements (regroup's `_POLL_S`): one cheap add."""
JOIN_IDLE_POLL_S = 0.02
"""Between looks of a worker waiting to be taken into a view (joiners' `_IDLE_POLL_S`): it sees the view within 20 ms."""
FORMING_FIRST_SLICE = 0.02
"""A group forming on a watched store (forming_store) waits this long for a peer's key before it first asks
whether the group was given up: the members of a healthy group publish within milliseconds of each other."""
FORMING_MAX_SLICE = 0.25
"""Slices double up to this: a group given up (a member died while it formed) is left within about 0.25 s,
at the price of one store read per waiting member per slice."""

# --- checkpoint: snapshots and the peer node's keeper -------------------------------------------------

FETCH_TIMEOUT = 30.0
"""Seconds one request to another node's keeper may take in all (connect, headers, body)."""
PUSH_TIMEOUT = 30.0
"""Seconds one copy of a snapshot to the peer node's keeper may take (the writer's drain at close too): as a fetch."""
PUSH_PAUSE = 30.0
"""Seconds without copies to the peer after one failed (a slow peer must not slow every step)."""
