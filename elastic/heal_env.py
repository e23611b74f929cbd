"""What torchrevive-run's agent and its workers agree on for heals in place.

With `TORCHREVIVE_SURVIVORS=keep` (and the c10d rendezvous), an agent whose
workers failed replaces them without a new rendezvous round, and the other
nodes' workers keep their processes (elastic.launcher.in_place, elastic.regroup).
Both sides meet on the rendezvous store, which no worker's death takes down:

- every worker gets `HEAL_STORE_ENV` (host:port of that store),
  `HEAL_NAMESPACE_ENV` (this round's namespace in it) and `HEAL_GENERATION_ENV`
  (0 at a round's start; n for a replacement started by the n-th heal);
- the agent counts heals with `add(GENERATION_KEY, 1)` on a `PrefixStore` of
  `namespace_prefix(namespace)` before it starts a replacement, and survivors
  wait for that count to pass their own generation;
- a worker that cannot heal exits with `HEAL_FAILED_EXIT`: its agent then
  restarts the whole group through a new round, as torchrun would.
"""

from __future__ import annotations

SURVIVORS_ENV = "TORCHREVIVE_SURVIVORS"
"""`keep`: heal in place; anything else (the default): restart every worker through a new round."""
HEAL_STORE_ENV = "TORCHREVIVE_HEAL_STORE"
HEAL_NAMESPACE_ENV = "TORCHREVIVE_HEAL_NAMESPACE"
HEAL_GENERATION_ENV = "TORCHREVIVE_HEAL_GENERATION"
GENERATION_KEY = "generation"
HEALERS_KEY = "healers"
"""Counted up by each worker that joined a group of the round through a heal point: the
agent heals in place only when the count reached the round's world size."""
HEAL_FAILED_EXIT = 76
"""A worker that could not regroup (a heal's peers never came): its agent starts a new round."""


def namespace_prefix(namespace: str) -> str:
    """The prefix (for a `PrefixStore`, which adds the "/") of one round's heals in the rendezvous store."""
    return f"torchrevive/heal/{namespace}"
