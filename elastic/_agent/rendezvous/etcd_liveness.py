"""etcd-v3's heartbeats: a key per node on a lease of its own (`lease_heartbeats`, through liveness.py), and
`AgentPresence`, the key on a lease that says an agent is alive.

Each node keeps `<prefix>/alive/<node>` (liveness.node_key) on a lease of `keep_alive_interval` x
`keep_alive_max_attempt` seconds, torch's time to declare a node dead: the lease's keep-alive (a few
bytes, on the presence's client thread) keeps it, and torch's timer writes nothing. Its value is a beat
(liveness.stamp) sealed like the agents' store's values (the job's secret, the launch's scope, the key),
rewritten every TTL / 2 on the presence's thread (which also makes good a lease etcd lost), and at once
when this node took a launch since it wrote it. A node whose
key is gone had no keep-alive for that long: torch's own rule declares it dead. A key whose value does
not verify (a stranger's, or sealed before its node took this launch) is no beat: the state's record
stands. Reading who is alive is one range of the `alive/` prefix per read of the state.

Invariants: a node's key exists before it joins a round (written when its handler is made) and from then
on while its agent runs; a clean exit revokes it (etcd_reopen.leave). Names read back are only compared with the
names this agent computes for the state's nodes: nothing read is parsed into a node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError

from elastic._agent.rendezvous import liveness
from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_messages import key_values
from elastic._agent.rendezvous.etcd_options import EtcdOptions
from elastic._shared.common import threads
from elastic._shared.storage.sealed_store import SealedStore

logger = logging.getLogger(__name__)


class AgentPresence:
    """This agent's key under a prefix, on a lease of `ttl` seconds of a client of its own: it exists
    while the agent runs (rewritten every ttl/2 s, so a lease etcd lost is made good) and is gone
    within `ttl` of its death. `name`: the key's last part (default: a fresh random one)."""

    def __init__(
        self, options: EtcdOptions, prefix: bytes, ttl: int, name: bytes | None = None,
        value: Callable[[bytes], bytes] | None = None,
    ) -> None:
        """`value(key)`: what the key holds, made afresh at each write (default: this host and pid)."""
        self._client = EtcdClient(dataclasses.replace(options, ttl=ttl))
        self.key = prefix + (name if name is not None else uuid.uuid4().hex.encode())
        who = f"{socket.gethostname()} pid {os.getpid()}".encode()
        self._value = value if value is not None else (lambda key: who)
        self._period = max(ttl / 2.0, 0.5)
        self._lock = threading.Lock()
        self._left = threading.Event()
        self._keeper: threading.Thread | None = None

    def enter(self) -> None:
        try:
            self._put()
        except BaseException:
            self._left.set()
            self._client.close(revoke=True)
            raise
        # Stopped and joined at exit (elastic._shared.common.threads): after SIGTERM it may be inside gRPC's C++.
        self._keeper = threads.start(self._keep, name="etcd-rdzv-presence", stop=self._left.set)

    def _put(self) -> None:
        self._client.txn([], [self._client.put_op(self.key, self._value(self.key))], [], what="announce this agent")

    def _keep(self) -> None:
        while not self._left.wait(self._period):
            self.renew()

    def renew(self) -> None:
        """Write the key again now (its value made afresh), unless this agent left."""
        with self._lock:  # never write the key again once `leave` revoked its lease
            if self._left.is_set():
                return
            try:
                self._put()
            except RendezvousError as exc:
                logger.warning("%s", exc)

    def leave(self) -> None:
        """Revoke the lease, which deletes the key (idempotent; if etcd cannot be
        reached, the key expires within `ttl`)."""
        with self._lock:
            if self._left.is_set():
                return
            self._left.set()
        self._client.close(revoke=True)


def lease_heartbeats(
    node: Any, settings: Any, options: EtcdOptions, client: EtcdClient, alive: bytes, store: SealedStore,
    scope_of: Callable[[str], str],
) -> tuple[liveness.Heartbeats, AgentPresence]:
    """Heartbeats for torch's `node` (rendezvous `settings`) as its key under `alive` on a lease of its own,
    sealed as `store` (the agents' sealed store) seals (`scope_of(launch)`: a launch's scope), and the
    presence that keeps the key, entered."""
    dead_after = liveness.dead_after_seconds(settings)
    sealed_in: list[str | None] = [None]

    def value(key: bytes) -> bytes:
        sealed_in[0] = store.current_scope()
        return store.seal(key, liveness.stamp())

    presence = AgentPresence(options, alive, dead_after, liveness.node_key(node).encode(), value=value)
    presence.enter()
    read_all = read_leases(client, alive, store, scope_of, dead_after)

    def read(nodes: Sequence[Any], launch: str | None) -> dict[Any, datetime | None]:
        if launch is None and sealed_in[0] != store.current_scope():
            presence.renew()  # this node took the job's launch: its beat in it before the others read it
        return read_all(nodes, launch)

    half = settings.keep_alive_interval.total_seconds() / 2
    return liveness.Heartbeats(_lease_beats, read, half), presence


def read_leases(client: Any, alive: bytes, store: SealedStore, scope_of: Callable[[str], str], dead_after: int) -> liveness.Beats:
    """The nodes' beats read from their keys under `alive` (`client`: an `EtcdClient`'s `range`), one range a read."""

    def read(nodes: Sequence[Any], launch: str | None) -> dict[Any, datetime | None]:
        scope = None if launch is None else scope_of(launch)
        wanted = {liveness.node_key(node) for node in nodes}
        reply = client.range(alive, prefix=True, what="read which agents are alive")
        beats = {}
        for kv in key_values(reply):
            name = kv.key[len(alive):].decode(errors="replace")
            if name in wanted:  # (a node not in the state yet may still beat in its own draft launch)
                beats[name] = liveness.beat_time(store.open(kv.key, kv.value, scope=scope))
        return liveness.lease_beats(beats, nodes, timedelta(seconds=dead_after))

    return read


def _lease_beats() -> None:
    """torch's heartbeat timer's work: none (the presence's thread keeps this node's key)."""
