"""torchrun's dynamic rendezvous on etcd's v3 API: `--rdzv-backend=etcd-v3`.

torch's own `etcd` and `etcd-v2` backends speak only etcd's v2 API, which etcd
3.4 serves only with `--enable-v2` and etcd 3.6 removed. This backend keeps the
rendezvous state, and the c10d store the agents share, in etcd v3 over gRPC
(`etcd_client`). After `pip install`, the entry point `torchrun.handlers: etcd-v3`
makes it available to an unchanged training script:

    torchrun --nnodes=1:4 --rdzv-backend=etcd-v3 --rdzv-endpoint=h1:2379,h2:2379 \\
        --rdzv-id=job1 --rdzv-conf=ttl=3600,read_timeout=30 recipes/gpt.py

Options (`--rdzv-conf=name=value,...`), besides torch's own (join_timeout,
last_call_timeout, close_timeout, keep_alive_interval, ...):

============== ==============================================================
key_prefix     where the run's keys live; default `/torchrevive/<run id>`
ttl            seconds the run's keys outlive its last agent; default 7200.
               Every key is attached to its writer's lease, which a thread
               keeps alive while the agent runs: abandoned runs disappear.
read_timeout   seconds one etcd operation may take, retries and failover
               included; default 60. Also how long torchrun tries an
               unreachable etcd at start before it gives up.
protocol       `http` (default) or `https` (needed by any credential)
liveness_ttl   seconds an agent's key outlives it when it dies without a clean
               exit; default 10 (see "Relaunching with the same id" below)
ca_cert        CA that signed etcd's server certificate (https). Only the
               options are trusted: CA bundles and proxies in the
               environment are ignored.
ssl_cert       client certificate, for etcd's `--client-cert-auth`
ssl_cert_key   the client certificate's private key
user           etcd user, when etcd has auth enabled (https only)
password_file  file whose first line is the user's password. `password=`
               itself is refused: torchrun logs its options at INFO
============== ==============================================================

A run id is 1-128 of `[A-Za-z0-9._-]` and none of the layout's names below
(`rdzv`, `store`, `store.ops`, `agents`, `alive`), nor may any '/'-part of a key_prefix
be one: so no run's keys ever fall in another run's ranges (etcd_options.py).

With `--client-cert-auth` and auth both on, a client certificate and a
`user`/`password` login work together (the login's token names the user).

Layout under the key prefix (default `/torchrevive/<run id>`):

    <prefix>/rdzv/state      the dynamic rendezvous state (pickled by torch, sealed
                             and checked by `state_guard`), framed
    <prefix>/store/<key>     the agents' c10d store (`EtcdStore`)
    <prefix>/store.ops/<id>  the store's markers that make a retried add count once
    <prefix>/agents/<id>     one key per live agent, on a short lease of its own
    <prefix>/alive/<node>    one key per node, on a lease of torch's dead-after time: its heartbeat

Invariant: the fencing token of the state is the key's mod revision; a state is
written only by a transaction that compares it (or, with no token, that the key
does not exist), so two agents never both win the same round.

Relaunching with the same id. torch closes the rendezvous when a job ends
(finished, or out of restarts), and a closed state refuses every agent; it lives
on the lease of the agent that closed it, up to `ttl`. So that a job launched
again with the same `--rdzv-id` resumes:

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
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import time
import zlib

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

from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_liveness import AgentPresence
from elastic._agent.rendezvous.etcd_messages import (
    KeyValue,
    key_values,
    prefix_end,
    txn_range_results,
    txn_revision,
)
from elastic._agent.rendezvous.etcd_options import EtcdOptions, EtcdOptionsError
from elastic._agent.rendezvous.etcd_store import EtcdStore
from elastic._agent.rendezvous.state_guard import StateGuard
from elastic._shared.storage.peer_auth import PeerKey

__all__ = [
    "BACKEND_NAME",
    "AgentPresence",
    "EtcdRendezvousBackend",
    "EtcdStore",
    "RunKeys",
    "create_backend",
    "leave",
    "reopen_closed_run",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
DEFAULT_LIVENESS_TTL = 10
DEFAULT_JOIN_TIMEOUT = 600  # torch's own default for join_timeout

# The state is framed so that a value etcd returns intact but which is not ours
# (written by hand, truncated, another tool's) is told apart from a valid state.
_MAGIC = b"torchrevive-rdzv/1"


def encode_state(state: bytes) -> bytes:
    return b"%s %08x\n" % (_MAGIC, zlib.crc32(state)) + state


def _encode(data: bytes) -> str:
    """A key or value as etcd's JSON API spells it (base64)."""
    return base64.b64encode(data).decode()


def decode_state(value: bytes, where: str) -> bytes:
    header, newline, state = value.partition(b"\n")
    magic, _, checksum = header.partition(b" ")
    if not newline or magic != _MAGIC:
        raise RendezvousStateError(f"the rendezvous state at {where} is not a torchrevive state (corrupt or foreign)")
    if checksum != b"%08x" % zlib.crc32(state):
        raise RendezvousStateError(f"the rendezvous state at {where} is corrupt (checksum mismatch)")
    return state


class EtcdRendezvousBackend(RendezvousBackend):
    """The dynamic rendezvous state in one etcd key, compare-and-set on its mod revision; what torch
    writes is sealed by `guard`, and what it reads is what `guard` admitted."""

    def __init__(self, client: EtcdClient, key: bytes, guard: StateGuard) -> None:
        self._client = client
        self._key = key
        self.guard = guard
        self._where = f"etcd {client.endpoints_text} key {key.decode(errors='replace')}"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def client(self) -> EtcdClient:
        return self._client

    def get_state(self) -> tuple[bytes, Token] | None:
        return self.state_through(self.guard)

    def state_through(self, guard: StateGuard) -> tuple[bytes, Token] | None:
        """The state as `guard` admits it, and its token (None: there is none)."""
        kv = self._client.get(self._key, what="read the rendezvous state")
        return None if kv is None else (guard.admit(decode_state(kv.value, self._where)), kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is None:
            compare = {"key": _encode(self._key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        else:
            revision = _revision_of(token)
            if revision is None:  # not a token this backend handed out: it cannot match
                current = self.get_state()
                return None if current is None else (*current, False)
            compare = {"key": _encode(self._key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}
        sealed, seq = self.guard.sealed(state)
        reply = self._client.txn(
            [compare],
            success=[self._client.put_op(self._key, encode_state(sealed))],
            failure=[self._client.range_op(self._key)],
            what="write the rendezvous state",
        )
        if reply.get("succeeded"):
            self.guard.won(state, seq, sealed)
            return state, txn_revision(reply), True
        # The failure branch read the key in the same transaction: what we return
        # is exactly the state that beat us, with its token.
        kvs = txn_range_results(reply)[0]
        return None if not kvs else (*self._decoded(kvs[0]), False)

    def _decoded(self, kv: KeyValue) -> tuple[bytes, Token]:
        return self.guard.admit(decode_state(kv.value, self._where)), kv.mod_revision


def _revision_of(token: Token) -> int | None:
    try:
        revision = int(token)
    except (TypeError, ValueError):
        return None
    return revision if revision > 0 else None


def create_backend(
    params: RendezvousParameters, key: PeerKey | None = None
) -> tuple[EtcdRendezvousBackend, Store]:
    """The backend and agent store for one torchrun agent, like torch's built-in factories.

    Connects (and authenticates) at once, so an unreachable etcd fails here, within
    `read_timeout`, with the endpoints named. The state is signed with `key`, the job's secret
    (None: an unsigned job).
    """
    options = EtcdOptions.from_params(params)
    guard = StateGuard.for_run(params.run_id, key)
    client = EtcdClient(options)
    prefix = options.key_prefix.encode()
    backend = EtcdRendezvousBackend(client, prefix + b"/rdzv/state", guard)
    store = EtcdStore(client, prefix + b"/store/")
    return backend, store


def positive_int(params: RendezvousParameters, name: str, default: int) -> int:
    text = params.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(str(text))
    except ValueError:
        value = 0
    if value <= 0:
        raise EtcdOptionsError(f"rdzv-conf {name} must be a positive integer, not {text!r}")
    return value


# --- relaunching a closed run (see the module docstring) ------------------------------


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
    revision = _revision_of(token)
    if revision is None:
        return False
    agents = keys.agents
    compare = [
        {"key": _encode(keys.state), "result": "EQUAL", "target": "MOD", "mod_revision": revision},
        {"key": _encode(agents), "range_end": _encode(prefix_end(agents)), "result": "EQUAL",
         "target": "CREATE", "create_revision": 0},
    ]
    deletes = [{"request_delete_range": {"key": _encode(keys.state)}}] + [
        {"request_delete_range": {"key": _encode(r), "range_end": _encode(prefix_end(r))}}
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
