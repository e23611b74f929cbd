"""The simulator's paths that agree through collectives: N ranks as threads on a `SimWorld` group.

The real code takes its group (`group=`), so each rank thread hands it its `SimGroup`, which counts
the collectives a rank takes and the bytes it receives (scale_count.py). Figures are per event.

- `memory-restore`: the memory restore's lookup (elastic._worker.checkpoint.memory_source.MemorySource):
  every rank learns its node's peer keeper (the keepers' ring, keeper_ring.peer_keeper), reports what
  its node holds (the parts' headers: each node holds its 8 ranks' parts and its previous node's
  replicas, with a real trainer state and RNG per part), rank 0 plans the restore and every rank
  learns the decision (the planner's broadcast, agreement.from_main). Rank 0 is the aggregator.
- `vote-slots`: `VOTES` step votes with `--slow-ranks report` (elastic._worker.control.step_vote.StepVote
  carrying elastic._worker.observe.slow_ranks.SlowRanks's figures, and the figures' verdict on every
  rank); per vote.
- `replica-check`: `CHECKS` replica checks' digest exchanges (elastic._worker.integrity.digest_exchange),
  every rank's parameters alike; per check.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch
from scale_count import SimWorld
from scale_model import Row, once, per_count
from scale_sim import Phase, Slice

from elastic._worker.control import agreement
from elastic._worker.runtime.context import WorkerContext

NODE_RANKS = 8
VOTES = 5
CHECKS = 5


def _ctx(rank: int, n: int) -> WorkerContext:
    return WorkerContext(rank=rank, local_rank=rank % NODE_RANKS, world_size=n, local_world_size=NODE_RANKS,
                         restart_count=0, run_id="sim", device=torch.device("cpu"), backend="gloo")


def _threads(sl: Slice, body: Any) -> None:
    """`body(rank, group)` on a thread per rank, each with its `SimGroup`; counts into `sl`'s phases."""
    world = SimWorld(sl.n)
    groups = world.groups()
    errors: list[BaseException] = []
    threading.stack_size(512 * 1024)

    def run(rank: int) -> None:
        try:
            body(rank, groups[rank])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(sl.n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{sl.path} at N={sl.n}: a rank failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    for rank, tally in enumerate(world.tallies):
        sl.tallies[rank] = tally


def _phase(sl: Slice, name: str, rank: int, group: Any, seconds: float) -> None:
    tally = group.tally
    with sl._lock:
        phase = sl.phases.setdefault(name, Phase())
        phase.ops[rank] = phase.ops.get(rank, 0) + tally.collectives
        phase.collective_bytes[rank] = phase.collective_bytes.get(rank, 0) + tally.collective_bytes
        phase.bytes[rank] = phase.collective_bytes[rank]
        phase.extra["seconds"] = max(phase.extra.get("seconds", 0.0), seconds)
    tally.collectives = tally.collective_bytes = 0


# -- the memory restore's lookup ----------------------------------------------------------------------------


class _Memory:
    """A node's snapshot tier as the lookup sees it: its keeper (where it runs) and what it holds."""

    def __init__(self, ctx: WorkerContext, headers: list[tuple[str, str]]) -> None:
        self.node = f"node{ctx.rank // NODE_RANKS}"
        self.ctx = self._ctx = ctx
        self.headers = headers
        self.keeper = type("Keeper", (), {"node": self.node, "url": f"http://10.0.{ctx.rank // NODE_RANKS // 250}."
                                                                     f"{ctx.rank // NODE_RANKS % 250}:7070"})()
        self.generation = ""
        self.part_writer = type("PartWriter", (), {"peer": None})()  # where `connect` puts the peer it picked

    def connect(self, group: Any) -> None:
        from elastic._worker.checkpoint.memory import MemorySnapshots

        MemorySnapshots.connect(self, group)  # the real placement, on this stand-in's keeper

    def inventory(self) -> Any:
        from elastic._worker.checkpoint import memory

        from elastic._worker.checkpoint import keeper_ring

        held = [list(entry) for entry in self.headers]
        ranks = [int(json.loads(header)["rank"]) for _, header in self.headers]
        share = getattr(keeper_ring, "share_of_node", None)  # the parts this rank reports of its node's
        return memory.Inventory(self.node, self.keeper.url, 100, share(self.ctx, held, ranks) if share else held)


def _headers(n: int) -> tuple[Any, dict[int, list[tuple[str, str]]]]:
    """A training state of one tensor (rows split between the ranks), and each node's parts as its keeper
    lists them: its own ranks' ("local") and its previous node's ("replica"), each with a real trainer
    state holding that rank's RNG."""
    from elastic._shared.storage import parts
    from elastic._shared.storage.chunks import BLOCK, StoredChunk, block_checksums
    from elastic._worker.checkpoint.training_state import TrainingState
    from elastic._worker.data.sampler import ElasticSampler
    from elastic._worker.runtime.rng import get_rng_state

    model = torch.nn.Linear(16, 4 * n, bias=False)
    state = TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          sampler=ElasticSampler(4096, batch_size=n, seed=0))
    rng = get_rng_state(torch.device("cpu"))
    trainer = state.trainer_state(100, n, [rng], {}, state.optimizer_settings(), check=False)
    encoded, crc = parts.encode_trainer(trainer)
    rows = torch.zeros(4, 16)
    data = memoryview(rows.numpy().tobytes())
    by_node: dict[int, list[tuple[str, str]]] = {}
    nodes = max(1, n // NODE_RANKS)
    for rank in range(n):
        writer = f"{1000 + rank:x}-abcdef"
        stem = parts.part_stem(rank, writer, 0)
        chunk = StoredChunk(stem + parts.DATA_SUFFIX, 0, len(data), "torch.float32", (4, 16),
                            tuple(block_checksums(data, BLOCK)), BLOCK).to_json()
        header = parts.PartHeader(
            run_id="sim", step=100, rank=rank, world_size=n, writer=writer, slot=0, data_bytes=len(data),
            chunks=[{"fqn": "model/weight", "at": [4 * rank, 0], **chunk}],
            tensors={"model/weight": {"dtype": "torch.float32", "size": [4 * n, 16]}},
            trainer=encoded, trainer_crc32c=crc, ckpt_dir="/sim/ckpt", keep=2, created=1.0,
            extra={"generation": "g1"},
        ).to_json().decode()
        node = rank // NODE_RANKS
        by_node.setdefault(node, []).append(("local", header))
        by_node.setdefault((node + 1) % nodes, []).append(("replica", header))
    return state, by_node


def memory_restore(sl: Slice) -> None:
    from elastic._worker.checkpoint import sources
    from elastic._worker.checkpoint.memory_source import MemorySource
    from elastic._worker.checkpoint.sources import Decision

    state, by_node = _headers(sl.n)
    decided: list[Any] = [None] * sl.n

    def body(rank: int, group: Any) -> None:
        ctx = _ctx(rank, sl.n)
        memory = _Memory(ctx, by_node[rank // NODE_RANKS])
        source = MemorySource(ctx, memory, state, ckpt_dir="/sim/ckpt", tag="t", newest_on_disk=-1,
                              deadline=time.monotonic() + 600, group=group)
        started = time.perf_counter()
        source.gather()
        offer = next(source.offers(), None) if ctx.is_main else None
        decision, rngs = Decision(offer=offer), []
        if hasattr(sources, "without_rngs"):  # (the planner's _next: each rank gets its own RNG state)
            decision, rngs = sources.without_rngs(decision)
        decision = agreement.from_main(ctx, decision if ctx.is_main else None, Decision, group)
        if hasattr(sources, "share_rngs") and decision is not None and decision.offer is not None:
            sources.share_rngs(ctx, decision.offer, rngs if ctx.is_main else None, group)
        decided[rank] = decision.offer.step if decision is not None and decision.offer is not None else None
        if decision is not None and decision.offer is not None:
            assert decision.offer.trainer["rng"][rank] is not None, "a rank restores without its RNG state"
        _phase(sl, "lookup", rank, group, time.perf_counter() - started)

    _threads(sl, body)
    sl.phases["lookup"].extra["offered"] = [step for step in set(decided)]


# -- the vote's slots (--slow-ranks) --------------------------------------------------------------------------


def vote_slots(sl: Slice) -> None:
    from elastic._worker.config import RunConfig
    from elastic._worker.control.collective_record import CollectiveRecord
    from elastic._worker.control.step_vote import Ballot, StepVote
    from elastic._worker.observe.events import EventLog
    from elastic._worker.observe.slow_ranks import SlowRanks

    def body(rank: int, group: Any) -> None:
        ctx = _ctx(rank, sl.n)
        ticks = iter(range(10**9))  # every rank's work the same: no straggler, the figures travel all the same
        slow = SlowRanks(ctx, RunConfig(slow_ranks="report"), EventLog(None, restart=0), None, group=group,
                         clock=lambda: next(ticks) * 0.01)
        vote = StepVote(ctx, Ballot, grace=15.0, group=group, record=CollectiveRecord(),
                        slots=slow.figures)
        vote.every = 1
        seconds = 0.0
        for step in range(VOTES + 1):
            slow.clock.started()
            slow.clock.ended(1)
            verdict = vote.step_ended(step)
            started = time.perf_counter()
            slow.verdict(verdict.slots, step)
            seconds = max(seconds, time.perf_counter() - started)
        vote.settle()
        _phase(sl, "vote", rank, group, seconds)
        sl.note("vote", "votes", vote.votes)

    _threads(sl, body)


# -- the replica check's exchange -----------------------------------------------------------------------------


def replica_check(sl: Slice) -> None:
    try:
        from elastic._worker.integrity.digest_exchange import exchange
    except ImportError:  # before it had a module: ReplicaCheck._exchange's all-gather of every rank's row
        from elastic._worker.integrity import replica_check as old

        def exchange(ctx: Any, digest: str, proposal: int, group: Any) -> Any:
            return old.decode_ballots(agreement.all_gather_rows(ctx, old.encode_ballot(digest, proposal), group))

    def body(rank: int, group: Any) -> None:
        ctx = _ctx(rank, sl.n)
        started = time.perf_counter()
        for _ in range(CHECKS):
            gathered = exchange(ctx, "ab" * 32, 5, group)
            assert len(set(gathered.digests)) == 1 and max(gathered.proposals) == 5
        _phase(sl, "check", rank, group, (time.perf_counter() - started) / CHECKS)

    _threads(sl, body)
    sl.phases["check"].extra["checks"] = CHECKS * sl.n


PATHS = {"memory-restore": memory_restore, "vote-slots": vote_slots, "replica-check": replica_check}
ROWS = [
    Row("memory restore: lookup and placement", "memory-restore", "lookup", once, aggregator=True, unit="collective"),
    Row("vote: --slow-ranks figures, per vote", "vote-slots", "vote", per_count("votes"), unit="collective"),
    Row("replica check: digest exchange, per check", "replica-check", "check", per_count("checks"), unit="collective"),
]
