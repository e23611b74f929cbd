"""What torchrevive-run's agent and its workers agree on for heals in place.

With `TORCHREVIVE_SURVIVORS=keep` (and the c10d rendezvous), an agent whose
workers failed replaces them without a new rendezvous round, and the other
nodes' workers keep their processes (elastic.launcher.in_place, elastic.regroup).
Both sides meet on the rendezvous store, which no worker's death takes down:

- every worker gets `HEAL_STORE_ENV` (host:port of that store),
  `HEAL_NAMESPACE_ENV` (this round's namespace in it) and `HEAL_GENERATION_ENV`
  (0 at a round's start; n for a replacement started by the n-th heal);
- each worker notes the generation whose group it joined under
  `member_key(rank)`; an agent whose workers failed raises `GENERATION_KEY`
  (on a `PrefixStore` of `namespace_prefix(namespace)`) to one past the
  newest generation they had joined (`healed_generation`) before it starts
  the replacements, and survivors wait for it to pass their own generation.
  So agents whose workers failed at the same time all start theirs into the
  same next generation, and a replacement that dies before its group formed
  is replaced into that generation again;
- a worker that cannot heal exits with `HEAL_FAILED_EXIT`: its agent then
  restarts the whole group through a new round, as torchrun would.
"""

from __future__ import annotations

SURVIVORS_ENV = "TORCHREVIVE_SURVIVORS"
"""`keep`: heal in place; anything else (the default): restart every worker through a new round."""
FROZEN_AFTER_ENV = "TORCHREVIVE_FROZEN_WORKER_SECONDS"
"""With `keep`: seconds a worker may stay stopped (SIGSTOP) before its agent ends it and replaces
it in place (elastic.launcher.reaper); its peers wait on it meanwhile."""
DEFAULT_FROZEN_AFTER = 3.0
HEAL_STORE_ENV = "TORCHREVIVE_HEAL_STORE"
HEAL_NAMESPACE_ENV = "TORCHREVIVE_HEAL_NAMESPACE"
HEAL_GENERATION_ENV = "TORCHREVIVE_HEAL_GENERATION"
GENERATION_KEY = "generation"
"""The newest heal's generation (a decimal count; absent: 0)."""
HEALERS_KEY = "healers"
"""Counted up by each worker that joined a group of the round through a heal point: the
agent heals in place only when the count reached the round's world size."""
HEAL_FAILED_EXIT = 76
"""A worker that could not regroup (a heal's peers never came): its agent starts a new round."""


def namespace_prefix(namespace: str) -> str:
    """The prefix (for a `PrefixStore`, which adds the "/") of one round's heals in the rendezvous store."""
    return f"torchrevive/heal/{namespace}"


def member_key(rank: int) -> str:
    """Where the worker of `rank` notes the generation whose group it joined last."""
    return f"member/{rank}"


def healed_generation(current: int, failed_in: list[int]) -> int:
    """The generation a heal forms: one past the newest the failed workers had joined, and never
    below the newest heal already counted (`current`), which the survivors may be forming."""
    return max([current, *(generation + 1 for generation in failed_in)])
