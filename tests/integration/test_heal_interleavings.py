"""Deterministic replays of the interleavings the soak (benchmarks/soak.py) found stalling a heal in
place, with ranks as threads (tests/thread_ranks.py): each test puts a survivor and a replacement at
the very point they met in the soak and checks that they make the same collectives, so neither
waits for the other until another failure frees it (issue 52)."""

from __future__ import annotations

import threading
from contextlib import ExitStack
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from thread_ranks import run_ranks

from elastic._agent.launcher.in_place import raise_generation
from elastic._shared.protocol import heal_env
from elastic._shared.storage.store_records import Records
from elastic._worker.survivors import regroup, views
from elastic._worker.survivors.forming_store import given_up
from elastic._worker.survivors.regroup import GroupBroken
from elastic._worker.survivors.views import View

from elastic._shared.protocol.fault_hook import NO_FAULTS
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity.loop_part import Integrity
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext

CKPT_EVERY = 10


def integrity_of(ctx: WorkerContext, group: Any, stack: ExitStack) -> Integrity:
    """One rank's integrity part in the default settings (replica checks `auto`, which also check
    before every periodic checkpoint), on the same model on every rank."""
    model = torch.nn.Linear(4, 2)
    init = torch.Generator().manual_seed(0)  # the same weights on every rank (threads share torch's default one)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=init))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = TrainingState(model=model, optimizer=optimizer, sampler=ElasticSampler(64, batch_size=2, seed=1))
    config = RunConfig(ckpt_every=CKPT_EVERY, ckpt_dir="unused")  # (a save is due every CKPT_EVERY steps)
    part = Integrity(ctx, config, EventLog(None, restart=0), group=group)
    return part.attach(state, optimizer, NO_FAULTS, stack)


def test_the_first_step_after_a_heal_that_is_a_checkpoint_step_is_checked_by_survivor_and_replacement_alike() -> None:
    """The soak's keep stall (and issue 52's 34 s one): a replacement took the state of step 119 and
    started its loop there; step 120 is a checkpoint step, before which every rank checks its replica.
    The survivor's first step end on the healed group used to skip the check (it only reset its
    checks), so the replacement waited in the check's exchange and the survivor in the save's
    broadcast, until another kill broke the group."""

    def body(ctx: WorkerContext, group: Any) -> tuple[int | None, int, int | None]:
        with ExitStack() as stack:
            part = integrity_of(ctx, group, stack)
            replacement = ctx.rank == 0
            part.loop_started(119)
            if not replacement:  # the survivor trained on the broken group; the heal formed a new one
                part.regrouped()
            back_to = part.step_ended(120, ctx, save_due=lambda step: step % CKPT_EVERY == 0)
            return back_to, part.check.checks, part.rollback.step

    results = run_ranks(2, body, timeout=20)
    assert results == [(None, 1, 120), (None, 1, 120)], "both checked step 120 before its save, once each"


# -- a member that dies while a group forms (issue 52's 11-minute keep stall, and train-on's GATHER_SECONDS) --

def tcp_store() -> tuple[Any, Any]:
    """A rendezvous store's server here and a client for the 'agent' (another connection, as another process's)."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    agent = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=60))
    return dist.PrefixStore("heal", master), dist.PrefixStore("heal", agent)


def test_a_member_killed_between_its_group_forming_and_noting_it_is_healed_past_and_its_partner_lets_go() -> None:
    """The soak's keep stall: a survivor died after generation 1's group formed but before it noted the
    generation. Its agent healed into generation 1 again (the same one), its replacement waited there,
    and its partner waited for it inside torch, building the checkpoint saver's group on generation 1's
    store (torch's `new_group`), for 11 minutes. Now a member notes the generation it arrives at before
    the group forms: the agent heals into generation 2, and the partner, waiting on the watched store,
    lets generation 1's group go at once (GroupBroken: it goes on to generation 2)."""
    store, agent_store = tcp_store()
    records, agent_records = Records(store, world=2), Records(agent_store, world=2)
    for rank in (0, 1):  # both noted generation 0 at the round's start, and the group of heal 1 forms
        records.set(heal_env.member_key(rank), "0")
    agent_store.add(heal_env.GENERATION_KEY, 1)
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            regroup.rejoin(store.clone(), generation=1, rank=rank, world_size=2, timeout=timedelta(seconds=30),
                           records=Records(store.clone(), world=2))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    # Both arrive at heal 1 (each its own process in a job: here rank 1's rejoin runs in a thread, and
    # only one default group exists per process, so rank 1 forms its side on a group of its own).
    threads = [threading.Thread(target=member, args=(0,)), threading.Thread(target=lambda: side_of_rank_1(store))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert not errors, errors
        assert records.get(heal_env.member_key(1)) == "1", "noted before its group formed"
        # Rank 1 dies now. Its agent heals past the generation it noted: the next one, not the same.
        assert raise_generation(agent_records, [1], started_in=0) == 2
        # Rank 0 builds the saver's group on the default group's store: rank 1 never comes.
        with pytest.raises(RuntimeError) as raised:
            dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=30))
        assert given_up(raised.value), raised.value
        # (given up, not timed out: a timeout is torch's DistStoreError, which carries no GIVEN_UP)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def side_of_rank_1(store: Any, generation: int = 1) -> None:
    """Rank 1's side of a heal's group, as a new process forms it: notes its arrival, then forms its end
    of the default group's mesh on the same namespace (rank 0's `init_process_group` waits for exactly
    these keys)."""
    records = Records(store.clone(), world=2)
    records.set(heal_env.member_key(1), str(generation))
    # (init_process_group's keys: the group's name, "0" in a new process, then the device's backend, "cpu")
    default_group = dist.PrefixStore("cpu/", dist.PrefixStore("0/", regroup.heal_group_store(store.clone(), generation)))
    dist.ProcessGroupGloo(default_group, 1, 2, timedelta(seconds=30))


def test_a_rejoin_given_up_is_a_group_broken_and_keeps_the_arrival_noted() -> None:
    """Rank 0 arrives at heal 1; rank 1 never does (it died), and its agent counts heal 2: rank 0's
    `rejoin` gives heal 1 up (GroupBroken: the heal goes on to the next generation, not a new round)."""
    store, agent_store = tcp_store()
    agent_store.add(heal_env.GENERATION_KEY, 1)
    timer = threading.Timer(0.5, lambda: agent_store.add(heal_env.GENERATION_KEY, 1))  # -> heal 2
    timer.start()
    try:
        with pytest.raises(GroupBroken, match="given up"):
            regroup.rejoin(store, generation=1, rank=0, world_size=2, timeout=timedelta(seconds=30),
                           records=Records(store, world=2))
    finally:
        timer.cancel()
    assert Records(agent_store, world=2).get(heal_env.member_key(0)) == "1"
    assert not dist.is_initialized()
    # Heal 2: its replacement is a new process, whose group torch names "0"; rank 0's next try must too
    # (the soak: after a given-up heal 1 the survivor named heal 2's group "1", and the two waited 300 s).
    peer = threading.Thread(target=side_of_rank_1, args=(store, 2), daemon=True)
    peer.start()
    try:
        regroup.rejoin(store, generation=2, rank=0, world_size=2, timeout=timedelta(seconds=10),
                       records=Records(store, world=2))
        assert dist.is_initialized() and dist.get_world_size() == 2
    finally:
        peer.join(30)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_view_whose_member_is_marked_failed_while_it_forms_is_given_up() -> None:
    """train-on: a member came to the view's gather, then died before the group formed; its agent marks
    it failed, and the others let the view's group go at once (they shrink), not after GATHER_SECONDS."""
    store, agent_store = tcp_store()
    records = Records(store, world=2)
    view = View(3, (heal_env.member_id(0, 0), heal_env.member_id(1, 0)))
    timer = threading.Timer(0.5, lambda: Records(agent_store, world=2).set(heal_env.failed_key(view.members[1]), "1"))
    timer.start()
    try:
        with pytest.raises(RuntimeError) as raised:
            dist.ProcessGroupGloo(views.view_group_store(store, view, records), 0, 2, timedelta(seconds=30))
    finally:
        timer.cancel()
    assert given_up(raised.value) and "failed while its group formed" in str(raised.value)


def test_a_group_whose_members_all_come_forms_on_the_watched_store_as_on_the_plain_one() -> None:
    store, _ = tcp_store()
    formed: list[Any] = [None, None]

    def rank(r: int) -> None:
        formed[r] = dist.ProcessGroupGloo(regroup.heal_group_store(store.clone(), 4), r, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(group is not None for group in formed)
    values = [torch.tensor([float(r + 1)]) for r in (0, 1)]
    works = [formed[r].allreduce([values[r]]) for r in (0, 1)]
    for work in works:
        work.wait()
    assert [v.item() for v in values] == [3.0, 3.0]
