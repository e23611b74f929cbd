"""Every move of the survivors' lifecycle (elastic._worker.survivors.lifecycle), made by the real heals on
ranks as threads: `Healing` and `GroupChanges` as a job runs them, each rank's groups its own gloo groups
(groups.Groups: one process holds one default group), on a real TCPStore namespace with the real
generation count, views, joiner tickets and watched group stores. The test's main thread is the agents:
it notes deaths, raises the heal count or marks a worker failed, and starts replacements. No model (the
state a heal takes is a step count); a rank dies as a SIGKILLed worker does: its sockets close.

Each scenario checks the path of phases every rank walked; together they make every move of the table."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from run_host_stub import RunHostStub

from elastic._agent.launcher.in_place import raise_generation
from elastic._shared.protocol import heal_env
from elastic._shared.storage.store_records import Records
from elastic._worker.runtime.context import WorkerContext
from elastic._worker.survivors import joiners, regroup, views
from elastic._worker.survivors.changes import GroupChanges
from elastic._worker.survivors.healing import Healing
from elastic._worker.survivors.lifecycle import TRANSITIONS, Lifecycle, Phase
from elastic._worker.survivors.regroup import HealPoint, RegroupError

TIMEOUT = timedelta(seconds=30)
STEP = "step"  # a training step's gradient all-reduce, on the rank's group


class ThreadGroups:
    """One rank's groups as a thread holds them (groups.Groups): gloo groups of its own."""

    def __init__(self) -> None:
        self.group: Any = None

    def form(self, store: dist.Store, *, rank: int, world_size: int, timeout: timedelta,
             form_within: timedelta | None = None) -> None:
        self.group = dist.ProcessGroupGloo(store, rank, world_size, min(timeout, form_within or timeout))

    def leave(self, model: Any = None) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.abort()  # its sockets close: a peer blocked on it fails at once, as when a worker dies

    def require_left(self, purpose: str) -> None:
        assert self.group is None, purpose

    def formed(self) -> bool:
        return self.group is not None


class Rank:
    """One worker: its heals, changes and lifecycle, on its own connection to the round's store."""

    def __init__(self, master: dist.TCPStore, *, rank: int, world: int, incarnation: int, mode: str,
                 step: int = 0, heal_wait: float = 20.0) -> None:
        store = dist.PrefixStore("heal", master.clone())
        point = HealPoint(store, incarnation, mode=mode, rank=rank, world_size=world,
                          records=Records(store, world=world))
        self.healing = Healing(point, timeout=TIMEOUT, heal_wait=timedelta(seconds=heal_wait), groups=ThreadGroups())
        self.ctx = WorkerContext(rank=rank, local_rank=0, world_size=world, local_world_size=1, restart_count=0,
                                 run_id="threads", device=torch.device("cpu"), backend="gloo")
        self.host = RunHostStub(self.ctx, step)
        self.optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        self.lifecycle = Lifecycle()
        self.changes = GroupChanges(self.healing, self.host, (self.optimizer, None, None), self.lifecycle)
        self.paths: list[list[str]] = []
        self.error: BaseException | None = None

    def first_group(self) -> None:
        """The group it starts in (a member's of the round, or a keep replacement's), and arm's move."""
        self.healing.groups.form(self.healing.first_group()["store"], rank=self.ctx.rank,
                                 world_size=self.ctx.world_size, timeout=TIMEOUT)
        regroup.count_healer(self.healing.point.signed_records, rank=self.ctx.rank, generation=self.healing.generation)
        self.changes.armed()  # as `Survivors.arm` makes it
        assert self.lifecycle.path() == FIRST_GROUP

    def train(self, until: int, *, void: bool = True) -> None:
        """Steps up to step `until`; a step whose all-reduce fails is healed (`void`: as a failed gradient
        all-reduce, trained again; else as failed bookkeeping: the step completed), and the rank goes on
        from the step the heal agreed on."""
        while self.host.step < until:
            started = self.healing.before_step(self.ctx.device, self.optimizer)
            try:
                self.healing.groups.group.allreduce([torch.ones(1)]).wait()
            except RuntimeError as error:
                if not void:
                    self.host.step += 1
                self.changes.failed(started if void else None, str(error))
                self.paths.append(self.lifecycle.path())
                continue
            self.host.step += 1

    def die(self) -> None:
        self.healing.groups.leave()

    def run(self, body: Any) -> threading.Thread:
        def guarded() -> None:
            try:
                body()
            except BaseException as error:  # noqa: BLE001 - the test reads it
                self.error = error

        thread = threading.Thread(target=guarded, daemon=True)
        thread.start()
        return thread


def store() -> dist.TCPStore:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    dist.PrefixStore("heal", master).add(heal_env.GENERATION_KEY, 0)
    return master


def agent_records(master: dist.TCPStore, world: int) -> Records:
    return Records(dist.PrefixStore("heal", master.clone()), world=world)


def wait_for(condition: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the ranks never got there"
        time.sleep(0.01)


def joined(*threads: threading.Thread, ranks: list[Rank]) -> None:
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a rank is still waiting"
    errors = [rank.error for rank in ranks if rank.error is not None]
    assert not errors, errors


M, V, L, A, F, C = "member", "void", "leaving", "awaiting", "forming", "catching up"
# The paths the scenarios below walk (each asserts its ranks walked exactly these); the last test checks
# that together they make every move of the table.
FIRST_GROUP = ["starting", M]
KEEP_VOID = [M, V, L, A, F, C, M]
KEEP_BOOKKEEPING = [M, L, A, F, C, M]  # the step had completed: nothing to undo
KEEP_REPLACEMENT = ["starting", C, M]
KEEP_GIVEN_UP_THEN_BROKEN = [M, V, L, A, F, L, A, F, C, L, A, F, C, M]
KEEP_NO_HEAL = [M, V, L, A, "left"]
TRAIN_ON_MEMBER_NEVER_CAME = [M, V, L, A, F, A, F, C, M]
TRAIN_ON_GROW = [M, L, F, C, M]
JOINER = ["starting", A, F, C, M]


def test_keep_a_void_step_and_failed_bookkeeping_heal_with_a_replacement_that_catches_up() -> None:
    master = store()
    ranks = [Rank(master, rank=r, world=3, incarnation=0, mode=heal_env.KEEP) for r in range(3)]
    starts = [rank.run(rank.first_group) for rank in ranks]
    joined(*starts, ranks=ranks)
    dead = ranks[2].run(lambda: (ranks[2].train(3), ranks[2].die()))
    survivors = [ranks[0].run(lambda: ranks[0].train(6)), ranks[1].run(lambda: ranks[1].train(6, void=False))]
    joined(dead, ranks=ranks)
    assert raise_generation(agent_records(master, 3), [2], started_in=0) == 1  # its agent heals it
    replacement = Rank(master, rank=2, world=3, incarnation=1, mode=heal_env.KEEP)

    def come_in() -> None:
        replacement.healing.groups.form(replacement.healing.first_group()["store"], rank=2, world_size=3,
                                        timeout=TIMEOUT)
        replacement.host.step = replacement.changes.catch_up_replacement()
        replacement.paths.append(replacement.lifecycle.path())
        replacement.train(6)

    joined(replacement.run(come_in), *survivors, ranks=[*ranks, replacement])
    assert ranks[0].paths == [KEEP_VOID]
    assert ranks[1].paths == [KEEP_BOOKKEEPING]
    assert replacement.paths == [KEEP_REPLACEMENT]
    assert {r.host.step for r in (ranks[0], ranks[1], replacement)} == {6}
    assert ranks[0].healing.generation == ranks[1].healing.generation == 1


def test_keep_a_group_given_up_while_it_forms_and_one_broken_while_it_catches_up_heal_in_later_generations() -> None:
    """The replacement of heal 1 arrives and dies before the group forms (the survivor gives heal 1 up on
    its watched store); heal 2's replacement dies right after the group formed (the survivor's catch-up
    breaks); heal 3 holds."""
    master = store()
    ranks = [Rank(master, rank=r, world=2, incarnation=0, mode=heal_env.KEEP) for r in range(2)]
    joined(*[rank.run(rank.first_group) for rank in ranks], ranks=ranks)
    records = agent_records(master, 2)
    dead = ranks[1].run(lambda: (ranks[1].train(2), ranks[1].die()))
    survivor = ranks[0].run(lambda: ranks[0].train(4))
    joined(dead, ranks=ranks)
    assert raise_generation(records, [1], started_in=0) == 1
    arrived_then_died = Rank(master, rank=1, world=2, incarnation=1, mode=heal_env.KEEP)
    arrived_then_died.healing.point.signed_records.set(heal_env.member_key(1), "1")  # as rejoin notes it, first
    wait_for(lambda: ranks[0].lifecycle.phase is Phase.FORMING and ranks[0].healing.generation == 1)
    assert raise_generation(records, [1], started_in=1) == 2, "it had arrived at heal 1: heal 2"
    formed_then_died = Rank(master, rank=1, world=2, incarnation=2, mode=heal_env.KEEP)

    def form_and_die() -> None:
        formed_then_died.healing.groups.form(formed_then_died.healing.first_group()["store"], rank=1, world_size=2,
                                             timeout=TIMEOUT)
        formed_then_died.die()

    joined(formed_then_died.run(form_and_die), ranks=[formed_then_died])
    assert raise_generation(records, [1], started_in=2) == 3
    last = Rank(master, rank=1, world=2, incarnation=3, mode=heal_env.KEEP)

    def come_in() -> None:
        last.healing.groups.form(last.healing.first_group()["store"], rank=1, world_size=2, timeout=TIMEOUT)
        last.host.step = last.changes.catch_up_replacement()
        last.train(4)

    joined(last.run(come_in), survivor, ranks=[ranks[0], last])
    assert ranks[0].paths == [KEEP_GIVEN_UP_THEN_BROKEN]
    assert ranks[0].healing.generation == 3 and ranks[0].host.step == last.host.step == 4


def test_keep_a_heal_no_agent_starts_leaves_the_survivors() -> None:
    master = store()
    ranks = [Rank(master, rank=r, world=2, incarnation=0, mode=heal_env.KEEP, heal_wait=0.3) for r in range(2)]
    joined(*[rank.run(rank.first_group) for rank in ranks], ranks=ranks)
    dead = ranks[1].run(lambda: (ranks[1].train(1), ranks[1].die()))
    survivor = ranks[0].run(lambda: ranks[0].train(3))
    survivor.join(60)
    dead.join(60)
    assert isinstance(ranks[0].error, RegroupError) and "no agent replaced the failed worker" in str(ranks[0].error)
    assert ranks[0].lifecycle.phase is Phase.LEFT
    assert [*ranks[0].lifecycle.history] == [Phase(p) for p in KEEP_NO_HEAL]


def test_train_on_a_view_a_member_never_came_to_is_formed_again_and_a_joiner_is_grown_in() -> None:
    """Rank 2 dies; rank 1 arrives for the next view and dies before it forms (its agent marks it
    failed), so rank 0 awaits the view after, alone; then a replacement waits to join and a grow
    admits it."""
    master = store()
    ranks = [Rank(master, rank=r, world=3, incarnation=0, mode=heal_env.TRAIN_ON) for r in range(3)]
    joined(*[rank.run(rank.first_group) for rank in ranks], ranks=ranks)
    records = agent_records(master, 3)
    mark = lambda rank: records.set(heal_env.failed_key(heal_env.member_id(rank, 0)), "1")  # noqa: E731

    class Died(Exception):
        pass

    def second_death(point: str) -> None:  # rank 1 arrived for the next view, which closed with it; it dies
        wait_for(lambda: views.read_view(records, 1) is not None)
        ranks[1].die()
        mark(1)
        raise Died()

    ranks[1].healing.fault = second_death
    first = ranks[2].run(lambda: (ranks[2].train(2), ranks[2].die(), mark(2)))
    others = [ranks[0].run(lambda: ranks[0].train(4)), ranks[1].run(lambda: ranks[1].train(4))]
    joined(first, others[0], ranks=[ranks[0], ranks[2]])
    others[1].join(60)
    assert isinstance(ranks[1].error, Died)
    assert ranks[0].paths == [TRAIN_ON_MEMBER_NEVER_CAME] and ranks[0].host.ctx.world_size == 1

    joiner = Rank(master, rank=2, world=3, incarnation=1, mode=heal_env.TRAIN_ON)
    admitted = joiner.run(lambda: (joiner.changes.join(), joiner.paths.append(joiner.lifecycle.path())))
    wait_for(lambda: joiners.joiners_waiting(records) > 0)  # its ticket is in (the members' vote carries it)
    ticket = joiners.joiners_waiting(records)
    grew = ranks[0].run(lambda: (ranks[0].changes.grow(ticket), ranks[0].paths.append(ranks[0].lifecycle.path())))
    joined(admitted, grew, ranks=[ranks[0], joiner])
    assert ranks[0].paths[-1] == TRAIN_ON_GROW and joiner.paths == [JOINER]
    assert ranks[0].host.ctx.world_size == joiner.host.ctx.world_size == 2


def test_the_scenarios_make_every_move_of_the_table() -> None:
    paths = [FIRST_GROUP, KEEP_VOID, KEEP_BOOKKEEPING, KEEP_REPLACEMENT, KEEP_GIVEN_UP_THEN_BROKEN, KEEP_NO_HEAL,
             TRAIN_ON_MEMBER_NEVER_CAME, TRAIN_ON_GROW, JOINER]
    made = {move for path in paths for move in zip(path, path[1:])}
    table = {(a.value, b.value) for a, moves in TRANSITIONS.items() for b in moves}
    assert table <= made, sorted(table - made)
