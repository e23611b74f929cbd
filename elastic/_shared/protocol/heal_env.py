"""What torchrevive-run's agent and its workers agree on for heals in place.

With `TORCHREVIVE_SURVIVORS=keep` or `train-on` (and the c10d rendezvous), an agent whose
workers failed replaces them without a new rendezvous round, and the other
nodes' workers keep their processes (elastic._agent.launcher.in_place, elastic._worker.survivors.regroup).
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

With `train-on` the survivors do not wait for the replacements: they form a
smaller group at once and train on, and a replacement joins at a later step
(elastic._worker.survivors.views keeps the membership). Then `HEAL_GENERATION_ENV` is the
worker's incarnation: 0 for a worker of the round's start, else a number no
other worker of the round has (`INCARNATIONS_KEY`), so `member_id(rank,
incarnation)` names one process; an agent marks each of its failed workers
under `failed_key(member)` before it starts their replacements, and tells its
workers the smallest world the job may train at (`MIN_WORLD_ENV`).
"""

from __future__ import annotations

from elastic._shared.timings import DEFAULT_FROZEN_AFTER  # noqa: F401 - --frozen-worker-seconds' default, here too

SURVIVORS_ENV = "TORCHREVIVE_SURVIVORS"
"""What a worker's death does to the others: `restart` (the default, also when unset): every worker
restarts through a new round and restores, bit-identical; `keep`: the others keep their processes
and wait for the replacement (a heal in place); `train-on`: the others keep their processes and
train on at a smaller world size until the replacement joins (exactly-once, not bit-identical)."""
RESTART, KEEP, TRAIN_ON = "restart", "keep", "train-on"
MODES = (RESTART, KEEP, TRAIN_ON)
MIN_WORLD_ENV = "TORCHREVIVE_MIN_WORLD"
"""With `train-on`: the fewest workers the job trains with (torchrun's minimum of nodes times the
workers per node); a group that would be smaller is not formed, and a new round waits for nodes."""
FROZEN_AFTER_ENV = "TORCHREVIVE_FROZEN_WORKER_SECONDS"
"""With `keep`: seconds a worker may stay stopped (SIGSTOP) before its agent ends it and replaces
it in place (elastic._agent.launcher.reaper); its peers wait on it meanwhile."""
# Internal plumbing, not settings: the agent sets these for its workers (MIN_WORLD_ENV too;
# elastic._agent.launcher.settings.INTERNAL lists every such variable). SURVIVORS_ENV and
# FROZEN_AFTER_ENV are settings: torchrevive-run's --survivors and --frozen-worker-seconds.
HEAL_STORE_ENV = "TORCHREVIVE_HEAL_STORE"
HEAL_NAMESPACE_ENV = "TORCHREVIVE_HEAL_NAMESPACE"
HEAL_GENERATION_ENV = "TORCHREVIVE_HEAL_GENERATION"
GENERATION_KEY = "generation"
"""The newest heal's generation (a decimal count; absent: 0)."""
HEALERS_KEY = "healers"
"""Counted up by each worker that joined a group of the round through a heal point: the
agent heals in place only when the count reached the round's world size."""
MAX_GENERATION = 1 << 30
"""The largest heal generation or incarnation: a counter in the store above it is not the job's."""
HEAL_FAILED_EXIT = 76
"""A worker that could not regroup (a heal's peers never came): its agent starts a new round."""


INCARNATIONS_KEY = "incarnations"
"""With `train-on`: counted up by an agent for each heal; the count is the replacements' incarnation."""
JOINERS_KEY = "joiners"
"""With `train-on`: counted up by each worker that waits to join the training group; the count is its ticket."""
ENDED_KEY = "ended"
"""With `train-on`: set once the job finished, so that a worker still waiting to join leaves too."""


def mode(environ: object) -> str:
    """The `SURVIVORS_ENV` setting of `environ` (a mapping); `ValueError` naming the choices when unknown."""
    value = str(environ.get(SURVIVORS_ENV, "") or RESTART)  # type: ignore[attr-defined]
    if value not in MODES:
        raise ValueError(f"{SURVIVORS_ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


def member_id(rank: int, incarnation: int) -> str:
    """One worker process of a round: its rank at the round's start and its incarnation."""
    return f"{rank}.{incarnation}"


def parse_member_id(text: str) -> tuple[int, int]:
    """(rank, incarnation) of a `member_id`; `ValueError` for anything else (it is read from a store)."""
    rank, dot, incarnation = text.partition(".")
    if not (dot and rank.isascii() and rank.isdigit() and incarnation.isascii() and incarnation.isdigit()
            and len(rank) <= 9 and len(incarnation) <= 10 and int(incarnation) <= MAX_GENERATION):
        raise ValueError(f"{text[:40]!r} is not a worker id RANK.INCARNATION")
    return int(rank), int(incarnation)


def failed_key(member: str) -> str:
    """Set by an agent for each of its workers that failed (`member_id`), before it replaces them."""
    return f"failed/{member}"


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
