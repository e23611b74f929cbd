"""etcd-v3's heartbeats: a key per node on a lease of its own (`lease_heartbeats`, through liveness.py), and
`AgentPresence`, the key on a lease that says an agent is alive.

Each node keeps `<prefix>/alive/<node>` (liveness.node_key) on a lease of `keep_alive_interval` x
`keep_alive_max_attempt` seconds, torch's time to declare a node dead: the lease's keep-alive (a few
bytes, on the presence's client thread) is the node's heartbeat, and torch's timer writes nothing. A node
whose key is gone had no keep-alive for that long: it beat at the latest that long ago, so torch's own
rule declares it dead. Reading who is alive is one `keys_only` range per read of the state.

Invariants: a node's key exists before it joins a round (written when its handler is made) and from then
on while its agent runs (the lease's keep-alive, the key rewritten every TTL / 2 in case etcd lost the
lease); a clean exit revokes it. Names read back are only compared with the names this agent computes for
the state's nodes: nothing read is parsed into a node.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import uuid
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousError

from elastic._agent.rendezvous import liveness
from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_messages import key_values
from elastic._agent.rendezvous.etcd_options import EtcdOptions
from elastic._shared.common import threads

logger = logging.getLogger(__name__)


class AgentPresence:
    """This agent's key under a prefix, on a lease of `ttl` seconds of a client of its own: it exists
    while the agent runs (rewritten every ttl/2 s, so a lease etcd lost is made good) and is gone
    within `ttl` of its death. `name`: the key's last part (default: a fresh random one)."""

    def __init__(self, options: EtcdOptions, prefix: bytes, ttl: int, name: bytes | None = None) -> None:
        self._client = EtcdClient(dataclasses.replace(options, ttl=ttl))
        self.key = prefix + (name if name is not None else uuid.uuid4().hex.encode())
        self._value = f"{socket.gethostname()} pid {os.getpid()}".encode()
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
        self._client.txn([], [self._client.put_op(self.key, self._value)], [], what="announce this agent")

    def _keep(self) -> None:
        while not self._left.wait(self._period):
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


def lease_heartbeats(handler: Any, client: EtcdClient, alive: bytes) -> None:
    """Make `handler`'s heartbeats its node's key under `alive` (an `AgentPresence` named `node_key`,
    already entered), and its copies of the state learn who is alive from those keys."""
    dead_after = timedelta(seconds=liveness.dead_after_seconds(handler))

    def beats(nodes: Any) -> dict[Any, Any]:
        reply = client.range(alive, prefix=True, keys_only=True, what="read which agents are alive")
        live = {kv.key[len(alive):].decode(errors="replace") for kv in key_values(reply)}
        return liveness.lease_beats(live, nodes, dead_after)

    liveness.install(handler, _lease_beats, beats)


def _lease_beats() -> None:
    """torch's heartbeat timer's work: none (the lease's keep-alive thread is this node's heartbeat)."""
