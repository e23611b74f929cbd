"""Relaunching an `etcd-v3` run with the same id, and leaving etcd at a clean exit.

torch closes the rendezvous when a job ends (finished, or out of restarts), and a
closed state refuses every agent; it lives on the lease of the agent that closed
it, up to `ttl`. So that a job launched again with the same `--rdzv-id` resumes:

- every agent keeps a key under `agents/` on a lease of `liveness_ttl` seconds
  (default 10) of a second client, kept alive while it runs and rewritten if
  etcd lost it: the key is gone within `liveness_ttl` of the agent's death, at
  once on a clean exit. The long `ttl` never decides whether anyone is alive.
- before it joins, an agent asks torch's own handler whether the state is closed
  (`is_closed()` of a handler on a read-only view of the backend that remembers
  the token of the state it handed torch). Only a state a `state_guard` admitted is
  unpickled, as on every read of torch's handler (the view's guard checks the seal
  and the pickle, not the launch: a closed state is always an earlier launch's to
  this agent), and torch's flag, set by whichever agent closed the run and however
  it did, is the one source of truth: a marker written beside it could disagree
  after a crash between two writes.
- a closed run is reopened by one transaction (`_remove_closed_run`):

      compare  mod_revision(<prefix>/rdzv/state) == the token seen closed
               create_revision == 0 over the range <prefix>/agents/   (no key)
      success  delete <prefix>/rdzv/state, <prefix>/store/*, <prefix>/store.ops/*, <prefix>/alive/*

  etcd applies it at one revision: if an agent wrote the state since (a live job,
  or another relauncher that won), or any agent is alive, nothing happens. The
  relauncher puts its own agent key only after this, so relaunchers never block
  each other; the losers look again and find the state gone or open. The store
  goes with the state because torch's round numbers start again at 0 and the
  dead job's round-0 keys (addresses, barrier counters) would be read as new.
- while agents of the job that closed the run are alive, a relauncher waits for
  them up to `join_timeout`, then fails with RendezvousClosedError naming them.
- at a clean exit (torch's `shutdown()`, which closes the rendezvous), an agent
  revokes its agent key's lease and runs the same transaction: the last one out
  leaves nothing of the run in etcd, and only it revokes its main lease. An agent
  that is not the last leaves its keys to `ttl` (`close(revoke=False)`): revoking
  would delete the closed state under agents still winding down, which would
  then start a rendezvous of their own instead of ending with the job. An agent
  killed, or stopped by a signal (torch does not close the rendezvous then),
  leaves its keys to their leases.

The run's layout under its key prefix is `RunKeys`'s (etcd.py lists it).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from elastic._agent.rendezvous.etcd import EtcdRendezvousBackend, revision_of
from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_liveness import AgentPresence
from elastic._agent.rendezvous.etcd_messages import encode, key_values, prefix_end
from elastic._agent.rendezvous.state_guard import StateGuard

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunKeys:
    """Where one run's keys live, under its key prefix."""

    prefix: bytes

    @property
    def state(self) -> bytes:
        return self.prefix + b"/rdzv/state"

    @property
    def store_ranges(self) -> tuple[bytes, bytes]:
        """The agents' store and its add/append markers (`EtcdStore`)."""
        return self.prefix + b"/store/", self.prefix + b"/store.ops/"

    @property
    def agents(self) -> bytes:
        return self.prefix + b"/agents/"

    @property
    def alive(self) -> bytes:
        """One key per node on its own lease: its heartbeat (etcd_liveness)."""
        return self.prefix + b"/alive/"


class _ReadingView(RendezvousBackend):
    """A backend that only reads, and remembers the token of the state it handed out:
    torch's handler on it says whether the state is closed, and this says which
    revision it judged."""

    def __init__(self, backend: EtcdRendezvousBackend) -> None:
        self._backend = backend
        self._guard = StateGuard(backend.guard._seal, warn=lambda line: None)
        self._guard.check_launch = False  # a look at the state: which launch it is does not matter here
        self.token: Token | None = None

    @property
    def name(self) -> str:
        return self._backend.name

    def get_state(self) -> tuple[bytes, Token] | None:
        current = self._backend.state_through(self._guard)
        self.token = None if current is None else current[1]
        return current

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        raise RendezvousStateError("internal error: the etcd-v3 closed-state check tried to write the state")


def _closed_token(backend: EtcdRendezvousBackend, store: Store, params: RendezvousParameters) -> Token | None:
    """The token of the rendezvous state if torch finds it closed; None if it is open or absent."""
    view = _ReadingView(backend)
    closed = create_handler(store, view, params).is_closed()
    return view.token if closed else None


def _remove_closed_run(client: EtcdClient, keys: RunKeys, token: Token) -> bool:
    """Delete the closed state (still at `token`) and the run's store, in one
    transaction, if no agent of the run is alive. True if it did."""
    revision = revision_of(token)
    if revision is None:
        return False
    agents = keys.agents
    compare = [
        {"key": encode(keys.state), "result": "EQUAL", "target": "MOD", "mod_revision": revision},
        {"key": encode(agents), "range_end": encode(prefix_end(agents)), "result": "EQUAL",
         "target": "CREATE", "create_revision": 0},
    ]
    deletes = [{"request_delete_range": {"key": encode(keys.state)}}] + [
        {"request_delete_range": {"key": encode(r), "range_end": encode(prefix_end(r))}}
        for r in (*keys.store_ranges, keys.alive)  # (no agent is alive: the dead ones' heartbeat keys go too)
    ]
    reply = client.txn(compare, success=deletes, failure=[], what="reopen the closed rendezvous")
    return bool(reply.get("succeeded"))


def _live_agents(client: EtcdClient, keys: RunKeys) -> list[str]:
    """Who holds an agent key of the run ('HOST pid PID')."""
    reply = client.range(keys.agents, prefix=True, what="list the run's live agents")
    return [kv.value.decode(errors="replace") for kv in key_values(reply)]


def reopen_closed_run(
    backend: EtcdRendezvousBackend, store: Store, params: RendezvousParameters, keys: RunKeys, *, timeout: float
) -> bool:
    """If the run is closed and none of its agents is alive, reopen it (delete its
    state and store); while agents are alive, wait up to `timeout` seconds for them
    to exit, then raise RendezvousClosedError naming them. True if it reopened the run."""
    run = params.run_id
    deadline = time.monotonic() + timeout
    waiting = False
    while (token := _closed_token(backend, store, params)) is not None:
        if _remove_closed_run(backend.client, keys, token):
            logger.info("rendezvous '%s': the job that closed it has ended; reopened it for this launch", run)
            return True
        alive = _live_agents(backend.client, keys)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if not alive:  # the state kept changing under us: let torch's join decide
                return False
            raise RendezvousClosedError(
                f"rendezvous '{run}' is closed and {len(alive)} agent(s) of the job that closed it are still "
                f"running after {timeout:g} s ({', '.join(sorted(alive)[:4])}): wait for that job to end, "
                "or use another --rdzv-id"
            )
        if alive and not waiting:
            waiting = True
            logger.warning(
                "rendezvous '%s' is closed by a job whose %d agent(s) are still running (%s); "
                "waiting up to %.0f s for them to exit before reopening it",
                run, len(alive), ", ".join(sorted(alive)[:4]), remaining,
            )
        time.sleep(min(0.5 if alive else 0.05, max(remaining, 0.0)))
    return False


def leave(
    closed: bool, backend: EtcdRendezvousBackend, store: Store, params: RendezvousParameters, keys: RunKeys,
    presences: list[AgentPresence],
) -> None:
    """After torch's `shutdown()` (`closed`: it closed the rendezvous), leave etcd: remove this agent's keys
    (its presence under `agents/`, its node's heartbeat under `alive/`) and, if it was the last agent out,
    the closed run itself."""
    last_out = False
    try:
        for presence in presences:
            presence.leave()
        token = _closed_token(backend, store, params) if closed else None
        last_out = token is not None and _remove_closed_run(backend.client, keys, token)
    except RendezvousError as exc:
        logger.warning(
            "rendezvous '%s': could not leave etcd cleanly (%s); this agent's keys expire on their own",
            params.run_id, exc,
        )
    # Only the last one out ends its lease: another agent's would take the closed
    # state with it while agents of the job are still winding down.
    backend.client.close(revoke=last_out)
