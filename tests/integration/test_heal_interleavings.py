"""Deterministic replays of the interleavings the soak (benchmarks/soak.py) found stalling a heal in
place, with ranks as threads (tests/thread_ranks.py): each test puts a survivor and a replacement at
the very point they met in the soak and checks that they make the same collectives, so neither
waits for the other until another failure frees it (issue 52)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from thread_ranks import run_ranks

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
