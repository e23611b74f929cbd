"""torchrun's dynamic rendezvous on etcd's v3 API: `--rdzv-backend=etcd-v3`.

torch's own `etcd` and `etcd-v2` backends speak only etcd's v2 API, which etcd
3.4 serves only with `--enable-v2` and etcd 3.6 removed. This backend keeps the
rendezvous state, and the c10d store the agents share, in etcd v3 through its
JSON gateway. After `pip install`, the entry point `torchrun.handlers: etcd-v3`
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
protocol       `http` (default) or `https`
ca_cert        CA that signed etcd's server certificate (https). Only the
               options are trusted: REQUESTS_CA_BUNDLE and proxies in the
               environment are ignored.
ssl_cert       client certificate, for etcd's `--client-cert-auth`
ssl_cert_key   the client certificate's private key
user           etcd user, when etcd has auth enabled
password_file  file whose first line is the user's password (stays out of `ps`)
password       the password itself
============== ==============================================================

With `--client-cert-auth` and auth both on, etcd's JSON gateway refuses client
certificates that carry a Common Name: issue the rendezvous's without one.

Layout under the key prefix (default `/torchrevive/<run id>`):

    <prefix>/rdzv/state    the dynamic rendezvous state (pickled by torch), framed
    <prefix>/store/<key>   the agents' c10d store (`EtcdStore`)

Invariant: the fencing token of the state is the key's mod revision; a state is
written only by a transaction that compares it (or, with no token, that the key
does not exist), so two agents never both win the same round.
"""

from __future__ import annotations

import zlib

from etcd3gw.utils import _encode
from torch.distributed import Store
from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from elastic.rendezvous.etcd_client import (
    EtcdClient,
    EtcdOptions,
    KeyValue,
    txn_range_results,
    txn_revision,
)
from elastic.rendezvous.etcd_store import EtcdStore

__all__ = ["BACKEND_NAME", "EtcdRendezvousBackend", "EtcdStore", "create_backend", "create_handler_v3"]

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
    """The dynamic rendezvous state in one etcd key, compare-and-set on its mod revision."""

    def __init__(self, client: EtcdClient, key: bytes) -> None:
        self._client = client
        self._key = key
        self._where = f"etcd {client.endpoints_text} key {key.decode(errors='replace')}"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        kv = self._client.get(self._key, what="read the rendezvous state")
        return None if kv is None else self._decoded(kv)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is None:
            compare = {"key": _encode(self._key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        else:
            revision = _revision_of(token)
            if revision is None:  # not a token this backend handed out: it cannot match
                current = self.get_state()
                return None if current is None else (*current, False)
            compare = {"key": _encode(self._key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}
        reply = self._client.txn(
            [compare],
            success=[self._client.put_op(self._key, encode_state(state))],
            failure=[self._client.range_op(self._key)],
            what="write the rendezvous state",
        )
        if reply.get("succeeded"):
            return state, txn_revision(reply), True
        # The failure branch read the key in the same transaction: what we return
        # is exactly the state that beat us, with its token.
        kvs = txn_range_results(reply)[0]
        return None if not kvs else (*self._decoded(kvs[0]), False)

    def _decoded(self, kv: KeyValue) -> tuple[bytes, Token]:
        return decode_state(kv.value, self._where), kv.mod_revision


def _revision_of(token: Token) -> int | None:
    try:
        revision = int(token)
    except (TypeError, ValueError):
        return None
    return revision if revision > 0 else None


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, Store]:
    """The backend and agent store for one torchrun agent, like torch's built-in factories.

    Connects (and authenticates) at once, so an unreachable etcd fails here, within
    `read_timeout`, with the endpoints named.
    """
    options = EtcdOptions.from_params(params)
    client = EtcdClient(options)
    prefix = options.key_prefix.encode()
    backend = EtcdRendezvousBackend(client, prefix + b"/rdzv/state")
    store = EtcdStore(client, prefix + b"/store/")
    return backend, store


def create_handler_v3(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's handler for `--rdzv-backend=etcd-v3`: torch's dynamic rendezvous on etcd v3."""
    backend, store = create_backend(params)
    return create_handler(store, backend, params)

