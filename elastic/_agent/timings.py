"""The agent side's clocks: every duration the layer waits, polls or gives up after is named here, so
that a reader sees the layer's clocks in one page.

Each module that uses one imports it under its old name (tests patch it there); this module imports
nothing from elastic, and tests/unit/test_timings.py keeps every such constant here, each with its reason.
Why the constants are not settings: elastic._agent.launcher.settings says.
"""

from __future__ import annotations

from datetime import timedelta

# --- launcher: watching the workers, stopping them --------------------------------------------------

TORCH_SLEEP = 0.001
"""What torch's loop sleeps between looks once the wait is ours (it sleeps before each look)."""
REAP_SECONDS = 0.1
"""After a death, how long a look goes on finding the workers healthy before it gives up for this
interval: a warm worker is the fork server's child, and torch learns of its exit only once the fork
server has reaped it and reported its status (a few milliseconds, more on a busy machine)."""
REAP_POLL = 0.005
"""Between those looks: a reap takes a few milliseconds."""
RETRY_SECONDS = 0.05
"""A stop signal that came in torch's unsafe spot is sent again after this: the cost of a wake-up against latency."""
EXIT_BARRIER_POLL_S = 0.05
"""Between counts of the nodes at the exit barrier (exit_barrier's `_POLL_S`): a wake-up's cost against latency."""

# --- launcher: failures, the notice board -----------------------------------------------------------

SAME_INCIDENT_SLACK = 10.0
"""Seconds after a hang verdict in which a primary failure of its culprit's node is still the hang's own
incident: the failure's agent posts it at its next look, which can come after the verdict."""
PRIMARY_WAIT = 5.0
"""Seconds an agent whose worker died of a peer's failure waits for that failure's own entry, and the
agent that stops a crash loop waits for every agent to read it: a few monitor intervals and store trips."""
FULL_READ_SECONDS = 5.0
"""With a change signal, a read looks past an empty slot at least this often (`StoreBoard.read_new`)."""

# --- launcher: the snapshot keeper ------------------------------------------------------------------

PRUNE_EVERY = 2.0
"""Seconds between the keeper's prunes of replaced parts when no persist wakes it sooner: disk is freed promptly."""
STALE_UPLOAD = 60.0
"""An unfinished upload's file this old is one that died (removed): a live upload's reads never stall 60 s."""
CLOSE_GRACE = 5.0
"""Seconds `close` waits for its cleanup beyond its own timeout (the lock, the checkpoint directory's stages)."""
HEADER_SECONDS = 20.0
"""A connection's TLS handshake, request line and headers arrive within this, however slowly they trickle:
a protocol bound that peers must agree on."""
STALE_SECRET = 3600.0
"""Seconds after which a secret made on this host for a run with no live keeper here is removed."""
OWNER_STALE = 600.0
"""Seconds without a heartbeat after which a keeper this process cannot check otherwise is taken to be gone."""

# --- rendezvous: rounds, the change signal, liveness ------------------------------------------------

MAX_WAIT_SECONDS = 1.0
"""The longest a waiting node sleeps without a change: torch's own poll interval."""
CAS_BACKOFF_FIRST_SECONDS = 0.002
"""A lost compare-and-set's jitter window starts here, doubling per loss in a row: N losers never rewrite at once."""
CAS_BACKOFF_MAX_SECONDS = 0.5
"""The window's cap (`cas_backoff`; torch 2.15+ has a setting): without it, 64 nodes took ~470 store operations a node."""
FULL_READ_EVERY_S = 5.0
"""A look reads the whole state at least this often even when no change was announced: an announcement
lost (a partitioned node's count that never landed) must delay a waiting node's admission, never stop it.
Torch's own look reads it every second; this keeps the O(N) read at a fifth of that."""
POLL_FIRST_SECONDS = 0.005
"""The first pause between reads of an unwatched change counter, doubling up to POLL_MAX_SECONDS."""
POLL_MAX_SECONDS = 0.05
"""Between reads of the change counter on a store that is not watched (TCPStore)."""
RESYNC_SECONDS = 5.0
"""`ChangeSignal.latest` reads the counter itself at least this often, whatever its watcher says."""
WATCH_FOR = timedelta(days=7)
"""How long the watcher's one wait may block (a TCPStore wait that times out warns, and its connection
is then out of step with the server: the watcher never lets one time out)."""
WAKE_TIMEOUT = timedelta(seconds=2)
"""The bound on the exit's one write that wakes the watcher (a stalled server: the exit's join bound then)."""
STRAY_PAUSE_SECONDS = 1.0
"""The watcher's pause when the key it waited on is set but the counter did not move (a stranger's)."""
SKEW = 60.0
"""Seconds a node's clock may run ahead of this one's before its beat is doubted."""
DEFAULT_LIVE_WITHIN = 15.0
"""torch's dead-node time with its defaults (keep_alive_interval 5 s, keep_alive_max_attempt 3)."""

# --- rendezvous: etcd --------------------------------------------------------------------------------

DEFAULT_LIVENESS_TTL = 10
"""Seconds an agent's key outlives it when it dies without a clean exit (`liveness_ttl`): a relaunch waits no longer for it."""
DEFAULT_JOIN_TIMEOUT = 600
"""torch's own default for join_timeout."""
DEFAULT_TTL = 7200
"""Seconds the run's keys outlive its last agent (`ttl`): torch's etcd backend's default, 2 hours."""
DEFAULT_READ_TIMEOUT = 60.0
"""Seconds one etcd operation may take, retries and failover included (`read_timeout`): as c10d's read_timeout."""
MAX_BACKOFF_SECONDS = 1.0
"""The longest wait between two rounds of failed requests, and between gRPC's reconnects."""
MAX_ATTEMPT_SECONDS = 5.0
"""One request never waits longer than this, so a silent endpoint is given up in
favour of the next one while the operation's budget still has time left."""
REVOKE_SECONDS = 5.0
"""What closing the client may spend revoking its lease before leaving it to expire."""
MIN_READ_SECONDS = 1.0
"""A read inside a wait may take this long even when the wait has less time left (etcd_store's
`_MIN_READ_SECONDS`): enough for a reachable etcd to answer, so a short wait sees a key that exists."""
FIRST_RETRY_SECONDS = 0.05
"""The first pause between attempts when etcd cannot be read or watched during a wait (`_FIRST_RETRY_SECONDS`)."""
MAX_RETRY_SECONDS = 1.0
"""The longest such pause (etcd_store's `_MAX_RETRY_SECONDS`)."""
