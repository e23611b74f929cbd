"""The shared layer's clocks: every duration the layer waits, polls or gives up after is named here, so
that a reader sees the layer's clocks in one page.

Each module that uses one imports it under its old name (tests patch it there); this module imports
nothing from elastic, and tests/unit/test_timings.py keeps every such constant here, each with its reason.
"""

from __future__ import annotations

# --- common: library threads ---------------------------------------------------------------------------

EXIT_JOIN_SECONDS = 10.0
"""How long the exit waits for every library thread together: longer than any
bounded wait inside them (a teardown's 5 s, a restore's last read), and under
torchrun's 30 s between SIGTERM and SIGKILL."""

# --- slurm: Slurm's own behaviour, measured -----------------------------------------------------------

SCONTROL_TIMEOUT = 20.0
"""Seconds a `scontrol` call may take (the controller answers in milliseconds; a busy one in seconds)."""
DUPLICATE_SIGTERM_WINDOW = 2.0
"""Seconds within which a second SIGTERM is Slurm's same one reaching a worker twice (see `preemption_settings`)."""

# --- protocol: between an agent and its workers -------------------------------------------------------

DEFAULT_FROZEN_AFTER = 3.0
"""--frozen-worker-seconds' default: a worker stopped this long is replaced; its peers wait on it meanwhile."""

# --- storage: stores, peers, object stores ------------------------------------------------------------

POLL_FIRST = 0.005
"""The first pause before a key whose value did not verify is read again, doubling up to POLL_MAX."""
POLL_MAX = 0.1
"""Seconds between looks at a key whose value did not verify (it reads as absent meanwhile)."""
WINDOW = 120.0
"""Seconds a signed request stays valid either side of the receiver's clock (nodes' clocks may differ this much)."""
CONNECT_TIMEOUT = 10.0
"""Seconds to connect to an object store: a stalled connect is a retried request, never a hung save or restore."""
READ_TIMEOUT = 60.0
"""Seconds per socket read: a stalled server is a retried request, never a hung save or restore."""
READ_DEADLINE = 60.0
"""The fixed part of a body's read deadline (plus its size over MIN_READ_RATE): a trickling server ends by then."""
