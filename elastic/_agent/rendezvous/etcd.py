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

Relaunching with the same id reopens a run that an ended job left closed, and
an agent leaves etcd at a clean exit: etcd_reopen.py says how.
"""

from __future__ import annotations

import zlib

from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_messages import KeyValue, encode, txn_range_results, txn_revision
from elastic._agent.rendezvous.etcd_options import EtcdOptions, EtcdOptionsError
from elastic._agent.rendezvous.etcd_store import EtcdStore
from elastic._agent.rendezvous.state_guard import StateGuard
from elastic._agent.timings import DEFAULT_JOIN_TIMEOUT, DEFAULT_LIVENESS_TTL  # noqa: F401 - the options' defaults, here too
from elastic._shared.storage.peer_auth import PeerKey

__all__ = [
    "BACKEND_NAME",
    "EtcdRendezvousBackend",
    "EtcdStore",
    "create_backend",
]

BACKEND_NAME = "etcd-v3"

# The state is framed so that a value etcd returns intact but which is not ours
# (written by hand, truncated, another tool's) is told apart from a valid state.
_MAGIC = b"torchrevive-rdzv/1"


def encode_state(state: bytes) -> bytes:
    return b"%s %08x\n" % (_MAGIC, zlib.crc32(state)) + state


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
            compare = {"key": encode(self._key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        else:
            revision = revision_of(token)
            if revision is None:  # not a token this backend handed out: it cannot match
                current = self.get_state()
                return None if current is None else (*current, False)
            compare = {"key": encode(self._key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}
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


def revision_of(token: Token) -> int | None:
    """The mod revision a token of this backend's stands for (None: not one of its tokens)."""
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
