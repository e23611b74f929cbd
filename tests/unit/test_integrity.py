"""Silent corruption and numeric faults (elastic._worker.integrity), one process: the digests' verdicts,
the classification of a replayed mismatch, the check interval, the numeric guard's decisions, the
rollback point, the tampering faults and the flags."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from elastic._shared.common.errors import ElasticError, UsageError
from elastic._worker.checkpoint.training_state import TrainingState
from elastic._worker.config import RunConfig, add_runtime_arguments
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.integrity import check_interval, numeric_guard, tamper, verdicts
from elastic._worker.integrity.digest_exchange import decode_ballots, encode_ballot
from elastic._worker.integrity.rollback import RollbackPoint
from elastic.chaos.faults import FaultInjector, parse_faults

A, B, C = "a" * 64, "b" * 64, "c" * 64


# -- what the digests say -------------------------------------------------------------


def test_equal_digests_agree_and_name_no_one() -> None:
    assert verdicts.compare([A, A, A]) == verdicts.Comparison(True, A, ())


def test_three_ranks_name_the_odd_one_by_majority() -> None:
    assert verdicts.compare([A, B, A]) == verdicts.Comparison(False, A, (1,))
    assert verdicts.compare([A, B, C, A, A]).odd == (1, 2)


def test_two_ranks_or_a_tie_name_no_one() -> None:
    assert verdicts.compare([A, B]) == verdicts.Comparison(False, None, ())
    assert verdicts.compare([A, A, B, B]) == verdicts.Comparison(False, None, ())
    assert verdicts.compare([A, B, C]) == verdicts.Comparison(False, None, ())
    with pytest.raises(ValueError):
        verdicts.compare([])


def test_a_replay_that_agrees_is_transient_named_by_the_first_majority() -> None:
    # The odd rank's gradients reach its peers through the all-reduce: every first digest differs from the replay's.
    assert verdicts.classify([A, B, A], [C, C, C]) == verdicts.Classified(verdicts.TRANSIENT, (1,))
    assert verdicts.classify([A, B], [C, C]) == verdicts.Classified(verdicts.TRANSIENT, ())


def test_the_same_rank_odd_again_is_its_node() -> None:
    assert verdicts.classify([A, B, A], [C, B, C]) == verdicts.Classified(verdicts.NODE, (1,))
    assert verdicts.classify([A, A, A, B], [A, A, C, A]) == verdicts.Classified(verdicts.NODE, (2,))


def test_two_ranks_differing_again_name_the_one_that_changed_its_own_result() -> None:
    assert verdicts.classify([A, B], [A, C]) == verdicts.Classified(verdicts.NODE, (1,))
    assert verdicts.classify([A, B], [A, B]) == verdicts.Classified(verdicts.NODE, ())  # nothing tells them apart
    with pytest.raises(ValueError):
        verdicts.classify([A, B], [A, B, A])


def test_a_retry_with_the_blocks_rotated_tells_the_batch_from_the_node() -> None:
    # three ranks: the replay's odd rank 1; rotated by one, block 1 is trained by rank 0
    assert verdicts.retried([A, B, A], [C, A, A], 1) == verdicts.Classified(verdicts.BATCH, (1,), (1,))
    assert verdicts.retried([A, B, A], [A, C, A], 1) == verdicts.Classified(verdicts.NODE, (1,))  # it stayed
    assert verdicts.retried([A, B, A], [A, A, A], 1) == verdicts.Classified(verdicts.NODE, (1,))  # gone: still the rank's
    assert verdicts.retried([A, B, A], [C, A, A], 0) == verdicts.Classified(verdicts.NODE, (1,))  # not rotated: no batch
    # two ranks: the results swap places with the blocks (a healthy rank's sum of two gradients is the same either way)
    assert verdicts.retried([A, B], [B, A], 1) == verdicts.Classified(verdicts.BATCH, (), (0, 1))
    assert verdicts.retried([A, B], [A, C], 1) == verdicts.Classified(verdicts.NODE, (1,))  # only rank 1 changed its own
    assert verdicts.retried([A, B], [A, B], 1) == verdicts.Classified(verdicts.NODE, ())  # each repeated: can't tell
    assert verdicts.retried([A, B], [B, A], 0) == verdicts.Classified(verdicts.NODE, ())
    with pytest.raises(ValueError):
        verdicts.retried([A, B], [A, B, A], 1)


def test_rotated_blocks_move_each_ranks_share_and_leave_the_stream_and_state_alone() -> None:
    sampler = ElasticSampler(64, batch_size=4, seed=3)
    batch = sampler.global_batch(3)
    sampler.rotation = 1
    assert [sampler.share(r, 3) for r in range(3)] == [(4, 4), (8, 4), (0, 4)]
    assert torch.equal(sampler.local_batch(2, 3), batch[:4]) and torch.equal(sampler.global_batch(3), batch)
    sampler.set_shares((2, 4, 6))
    assert [sampler.share(r, 3) for r in range(3)] == [(2, 4), (6, 6), (0, 2)]
    assert "rotation" not in str(sampler.state_dict())


def test_ballots_cross_as_fixed_rows_and_a_malformed_one_is_one_line() -> None:
    rows = [encode_ballot(A, 7), encode_ballot(B, 12)]
    assert decode_ballots(rows) == decode_ballots([r.clone() for r in rows])
    gathered = decode_ballots(rows)
    assert gathered.digests == [A, B] and gathered.proposals == [7, 12]
    with pytest.raises(ElasticError, match="rank 1 proposed an interval of 0 steps"):
        decode_ballots([rows[0], encode_ballot(B, 0)])
    with pytest.raises(ElasticError, match="rank 0 sent 3 bytes"):
        decode_ballots([torch.zeros(3, dtype=torch.uint8)])


# -- the interval -------------------------------------------------------------------------


def test_auto_takes_the_fewest_steps_within_half_a_percent() -> None:
    assert check_interval.auto_every(0.001, 0.1) == 2  # 1 ms every 2 steps of 100 ms: 0.5 %
    assert check_interval.auto_every(0.0011, 0.1) == 3
    assert check_interval.auto_every(0.05, 0.01) == 1000
    assert check_interval.auto_every(0.0, 0.1) == 1



def test_auto_counts_the_checks_at_every_checkpoint_in_its_budget() -> None:
    # 10 ms a check, 100 ms a step: alone every 20 steps; with one at each save every 50, every 34
    assert check_interval.auto_every(0.01, 0.1) == 20
    assert check_interval.auto_every(0.01, 0.1, also_every=50) == 34
    # the saves' checks alone use the budget up: no regular checks (the saves' are still made)
    assert check_interval.auto_every(0.01, 0.1, also_every=20) == check_interval.MAX_EVERY
    clock = Clock()
    interval = check_interval.CheckInterval("auto", clock=clock, also_every=50)
    for _ in range(3):
        clock.now += 0.1
        interval.note_step_end()
    interval.note_cost(0.01)
    assert interval.proposal() == 34


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_interval_is_measured_as_the_run_goes_and_agreed() -> None:
    clock = Clock()
    interval = check_interval.CheckInterval("auto", clock=clock)
    assert interval.every == check_interval.FIRST_AUTO and interval.proposal() == check_interval.FIRST_AUTO
    for _ in range(5):
        clock.now += 0.1
        interval.note_step_end()
    clock.now += 5.0  # a check's time is not a step's
    interval.note_step_end(paused=True)
    assert interval.step_s() == pytest.approx(0.1)
    interval.estimate(0.01)  # before the first check: the first rollback point's copy, twice
    assert interval.proposal() == 20
    interval.note_cost(0.02)  # 20 ms a check: 40 steps of 100 ms
    assert interval.proposal() == 40
    assert interval.agree(40) and interval.every == 40 and not interval.agree(40)
    interval.note_cost(0.022)
    interval.note_cost(0.022)  # within 25 %: unchanged
    assert interval.proposal() == 40
    assert "0.5%" in interval.describe()
    fixed = check_interval.CheckInterval(5, clock=clock)
    fixed.note_cost(10.0)
    assert fixed.proposal() == 5 and not fixed.auto


# -- the numeric guard ----------------------------------------------------------------------


def test_judge_names_non_finite_readings_and_spikes() -> None:
    window = [2.0] * 20
    assert numeric_guard.judge(numeric_guard.Reading(1.0, 2.1), window, 0.0) is None
    why, value = numeric_guard.judge(numeric_guard.Reading(1.0, math.nan), window, 0.0)
    assert why == "non-finite loss" and math.isnan(value)
    assert numeric_guard.judge(numeric_guard.Reading(math.inf, 2.0), window, 0.0)[0] == "non-finite gradient norm"
    assert numeric_guard.judge(numeric_guard.Reading(math.nan, None), window, 0.0)[0] == "non-finite gradient norm"
    assert numeric_guard.judge(numeric_guard.Reading(1.0, 7.0), window, 3.0)[0].startswith("loss spike")
    assert numeric_guard.judge(numeric_guard.Reading(1.0, 5.0), window, 3.0) is None
    assert numeric_guard.judge(numeric_guard.Reading(1.0, 70.0), window[:5], 3.0) is None  # the window is too short
    assert numeric_guard.judge(numeric_guard.Reading(1.0, 70.0), window, 0.0) is None  # spikes off


def _params(grad: float) -> list[torch.Tensor]:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), grad)
    return [p]


def test_stop_raises_one_line_before_the_update() -> None:
    guard = numeric_guard.NumericGuard("stop", spike=0.0, agree=lambda bad: bad)
    assert guard.before_update(1, _params(1.0), torch.tensor(2.0)) is None
    with pytest.raises(numeric_guard.NumericFault, match="step 2: non-finite loss") as caught:
        guard.before_update(2, _params(1.0), torch.tensor(math.nan))
    assert caught.value.exit_code == numeric_guard.NUMERIC_STOP_EXIT


def test_skip_drops_every_gradient_so_the_update_changes_nothing() -> None:
    guard = numeric_guard.NumericGuard("skip", spike=0.0, agree=lambda bad: bad)
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.full((3,), math.nan)
    assert guard.before_update(4, [param], None) == "skip"
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(3)) and not optimizer.state.get(param)
    assert guard.skipped == {4} and guard.caught[0]["why"] == "non-finite gradient norm"


def test_a_peers_bad_reading_makes_every_rank_act_and_a_skipped_step_is_skipped_again_unjudged() -> None:
    asked: list[bool] = []
    guard = numeric_guard.NumericGuard("rollback", spike=0.0, agree=lambda bad: asked.append(bad) or True)
    params = _params(1.0)
    assert guard.before_update(3, params, torch.tensor(1.0)) == "rollback"
    assert asked == [False] and guard.rollback_due == 3 and params[0].grad is None
    assert guard.caught[0]["why"] == "a peer's reading"
    resumed = numeric_guard.NumericGuard("rollback", spike=0.0, agree=lambda bad: asked.append(bad) or True)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.before_update(3, _params(1.0), torch.tensor(1.0)) == "skip" and asked == [False]


def test_under_rollback_the_replay_judges_the_step_again_a_batch_or_transient() -> None:
    guard = numeric_guard.NumericGuard("rollback", spike=0.0, agree=lambda bad: bad)
    assert guard.before_update(3, _params(1.0), torch.tensor(math.nan)) == "rollback"
    assert guard.skipped == {3} and guard.replaying == 3
    params = _params(1.0)
    assert guard.before_update(3, params, torch.tensor(math.nan)) == "skip" and params[0].grad is None  # again: the batch
    assert guard.take_outcome() == "batch" and guard.take_outcome() is None
    assert guard.caught[-1]["kind"] == "batch" and guard.skipped == {3}
    assert guard.before_update(3, _params(1.0), torch.tensor(1.0)) == "skip"  # a further replay or resume: unjudged
    transient = numeric_guard.NumericGuard("rollback", spike=0.0, agree=lambda bad: bad)
    transient.before_update(5, _params(1.0), torch.tensor(math.nan))
    params = _params(1.0)
    assert transient.before_update(5, params, torch.tensor(1.0)) is None and params[0].grad is not None  # applied
    assert transient.take_outcome() == "transient" and transient.skipped == set() and len(transient.caught) == 1


def test_a_step_skipped_for_its_batch_is_skipped_with_the_guard_off() -> None:
    guard = numeric_guard.NumericGuard("off", spike=0.0, agree=lambda bad: pytest.fail("no collective when off"))
    guard.skipped.add(6)
    params = _params(1.0)
    assert guard.before_update(6, params, None) == "skip" and params[0].grad is None
    assert guard.before_update(7, _params(math.nan), None) is None


def test_off_reads_nothing_and_a_bad_state_is_refused() -> None:
    guard = numeric_guard.NumericGuard("off", spike=0.0, agree=lambda bad: pytest.fail("no collective when off"))
    assert guard.before_update(1, _params(math.nan), torch.tensor(math.nan)) is None
    with pytest.raises(ValueError, match="no list of skipped steps"):
        guard.load_state_dict({"skipped": ["1"]})
    with pytest.raises(ValueError):
        numeric_guard.NumericGuard("maybe", spike=0.0, agree=lambda bad: bad)


# -- the rollback point ---------------------------------------------------------------------


def _training_state() -> tuple[TrainingState, torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    sampler = ElasticSampler(64, batch_size=4, seed=3)
    state = TrainingState(model=model, optimizer=optimizer, sampler=sampler, scheduler=scheduler)
    return state, model, optimizer, scheduler


def _train(state: TrainingState, model, optimizer, scheduler, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 4)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        state.sampler.advance(1)
        losses.append(loss.item())
    return losses


def _everything(model, optimizer, scheduler, sampler) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for i, s in optimizer.state_dict()["state"].items()},
            "lr": [g["lr"] for g in optimizer.param_groups], "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict()}


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, dict):
            if not _same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def test_a_rollback_replays_bit_for_bit_and_can_be_taken_again() -> None:
    state, model, optimizer, scheduler = _training_state()
    _train(state, model, optimizer, scheduler, 2)  # the optimizer holds state
    point = RollbackPoint(state, torch.device("cpu"))
    point.take(2)
    at_point = _everything(model, optimizer, scheduler, state.sampler)
    first = _train(state, model, optimizer, scheduler, 3)
    after_first = _everything(model, optimizer, scheduler, state.sampler)
    assert point.restore() == 2
    assert _same(_everything(model, optimizer, scheduler, state.sampler), at_point)
    replay = _train(state, model, optimizer, scheduler, 3)  # dropout and the batches draw the same numbers again
    assert replay == first and _same(_everything(model, optimizer, scheduler, state.sampler), after_first)
    assert point.restore() == 2  # the optimizer never stepped the point's own buffers
    assert _same(_everything(model, optimizer, scheduler, state.sampler), at_point)


def test_a_point_before_the_first_step_empties_the_optimizer_again() -> None:
    state, model, optimizer, scheduler = _training_state()
    point = RollbackPoint(state, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="no rollback point"):
        point.restore()
    point.take(0)
    before = _everything(model, optimizer, scheduler, state.sampler)
    first = _train(state, model, optimizer, scheduler, 2)
    point.restore()
    assert not optimizer.state_dict()["state"] and _same(_everything(model, optimizer, scheduler, state.sampler), before)
    assert _train(state, model, optimizer, scheduler, 2) == first


def test_a_verified_point_that_changed_in_memory_is_named_not_restored() -> None:
    from elastic._worker.integrity.rollback import PointChanged

    state, model, optimizer, scheduler = _training_state()
    point = RollbackPoint(state, torch.device("cpu"), verify=True, rank=2)
    taken = point.take(4)
    _train(state, model, optimizer, scheduler, 2)
    assert point.restore() == 4  # intact: restored as taken
    copy = next(t for k, t in taken.tensors.items() if "weight" in k)
    copy.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << tamper.BIT)  # a bit flips in the kept copy
    with pytest.raises(PointChanged, match="rank 2: its rollback point of step 4 changed in memory") as caught:
        point.restore()
    assert caught.value.exit_code == 80  # its node is set aside, as a node that computes wrong
    assert RollbackPoint(state, torch.device("cpu")).take(1).digest is None  # DDP: the replicas vouch instead


# -- tampering faults ---------------------------------------------------------------------


def test_a_flip_changes_one_bit_of_one_parameter() -> None:
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert tamper.flip_one_bit(model) == "weight"
    after = model.state_dict()
    changed = (before["weight"].view(torch.int32) ^ after["weight"].view(torch.int32)).view(-1)
    assert changed.tolist() == [1 << tamper.BIT] + [0] * 5 and torch.equal(before["bias"], after["bias"])


def test_an_armed_nan_hook_spoils_one_training_forward() -> None:
    model = torch.nn.Linear(3, 1)
    hook = tamper.NanLoss(model)
    x = torch.ones(2, 3)
    assert torch.isfinite(model(x)).all()
    hook.armed = True
    assert torch.isnan(model(x)).all() and not hook.armed
    assert torch.isfinite(model(x)).all()
    hook.remove()


def test_flip_and_nan_fire_once_per_worker_unless_every_attempt() -> None:
    env = {"ELASTIC_FAULT": "after_step@12:rank=1:do=flip,after_step@7:rank=1:do=nan:restart=any"}
    faults = FaultInjector(1, 0, env)
    assert not faults.tamper("after_step", 12, "nan")  # another action's step: not consumed
    assert faults.tamper("after_step", 12, "flip") and not faults.tamper("after_step", 12, "flip")  # a replay runs clean
    assert faults.tamper("after_step", 7, "nan") and faults.tamper("after_step", 7, "nan")  # every attempt
    faults.at("after_step", 12)  # a tampering fault kills nothing
    assert not FaultInjector(0, 0, env).tamper("after_step", 12, "flip")
    assert parse_faults("after_step@3:do=flip")[0].action == "flip"


def test_a_fault_that_follows_a_sample_fires_on_whichever_rank_trains_it_at_every_attempt() -> None:
    (fault,) = parse_faults("after_step@5:sample=301:do=flip")
    assert (fault.sample, fault.rank, fault.restart) == (301, None, None)
    assert parse_faults("after_step@5:sample=301:do=nan:restart=0")[0].restart == 0
    env = {"ELASTIC_FAULT": "after_step@5:sample=301:do=flip"}
    faults = FaultInjector(2, 1, env)  # any rank, any attempt
    assert not faults.tamper("after_step", 5, "flip")  # this rank trains other samples (or did not say)
    assert not faults.tamper("after_step", 5, "flip", [300, 302])
    assert faults.tamper("after_step", 5, "flip", [300, 301]) and faults.tamper("after_step", 5, "flip", [301])
    assert not faults.tamper("after_step", 6, "flip", [301])
    for bad, line in [("after_step@5:sample=3:do=kill", "sample=N goes with do=flip or do=nan and no rank="),
                      ("after_step@5:sample=3:rank=1:do=flip", "sample=N goes with do=flip or do=nan and no rank="),
                      ("after_step@5:sample=x:do=flip", "until=FILE, sample=N or do=kill")]:
        with pytest.raises(UsageError, match=line.replace("|", r"\|")):
            parse_faults(bad)


# -- the flags ------------------------------------------------------------------------------


def test_the_flags_parse_and_refuse_in_one_line() -> None:
    parser = argparse.ArgumentParser()
    add_runtime_arguments(parser)
    args = parser.parse_args(["--replica-check-every", "25", "--numeric-guard", "skip", "--loss-spike", "4"])
    config = RunConfig.from_args(args)
    assert (config.replica_check_every, config.numeric_guard, config.loss_spike) == (25, "skip", 4.0)
    assert RunConfig().replica_check_every == "auto" and RunConfig().numeric_guard == "off"
    with pytest.raises(UsageError, match="replica_check_every='often' must be auto"):
        RunConfig(replica_check_every="often")
    with pytest.raises(UsageError, match="numeric_guard='panic' is not one of off, stop, skip, rollback"):
        RunConfig(numeric_guard="panic")
    with pytest.raises(UsageError, match="loss_spike must be 0 or more"):
        RunConfig(loss_spike=-1.0)


def test_the_guards_state_is_optional_in_a_checkpoint_both_ways() -> None:
    from elastic._worker.checkpoint.fit import check_trainer

    state, *_ = _training_state()
    guard = numeric_guard.NumericGuard("skip", spike=0.0, agree=lambda bad: bad)
    guarded = TrainingState(model=state.model, optimizer=state.optimizer, sampler=state.sampler,
                            extra={numeric_guard.STATE_NAME: guard})
    saved = {"sampler": state.sampler.state_dict(), "scaler": None,
             "extra": {numeric_guard.STATE_NAME: {"skipped": [4, 9]}}}
    check_trainer("step_00000010", saved, state)  # saved with the guard, resumed without it
    check_trainer("step_00000010", {**saved, "extra": {}}, guarded)  # and the other way round
    guarded.apply_extra(10, {"extra": {}})
    assert guard.skipped == set()
    guarded.apply_extra(10, saved)
    assert guard.skipped == {4, 9}  # a resumed run skips them again


def test_the_skip_record_is_checkpointed_wherever_a_check_may_skip_a_batch() -> None:
    from elastic._worker.integrity.loop_part import Integrity
    from elastic._worker.observe.events import EventLog
    from elastic._worker.runtime.context import WorkerContext

    def part(world: int, **settings: object) -> Integrity:
        ctx = WorkerContext(rank=0, local_rank=0, world_size=world, local_world_size=world, restart_count=0,
                            run_id="r", device=torch.device("cpu"), backend="gloo" if world > 1 else None)
        return Integrity(ctx, RunConfig(**settings), EventLog(None, restart=0))

    assert numeric_guard.STATE_NAME in part(2).registered({"mine": 1})  # checks on (auto), guard off
    assert part(2, replica_check_every=0).registered(None) is None
    assert part(1).registered(None) is None  # one process: no replicas to check
    assert numeric_guard.STATE_NAME in part(1, numeric_guard="skip").registered(None)


# -- what the report and the metrics say ------------------------------------------------------


def test_the_report_gives_a_line_each_and_the_time_to_detect() -> None:
    from elastic.report import integrity as report

    events = [
        {"event": "step", "step": 12, "time": 100.0}, {"event": "step", "step": 15, "time": 101.5},
        {"event": "corruption", "step": 15, "kind": "transient", "ranks": [1], "nodes": ["node 1 (b)"],
         "rolled_back_to": 10, "steps_replayed": 5, "action": "rolled back to step 10 and replayed 5 step(s)",
         "detected_step": 15, "detected_time": 101.75},
        {"event": "step", "step": 12, "time": 102.0},  # the replay ends step 12 again
        {"event": "numeric", "step": 18, "why": "non-finite loss", "value": math.nan, "action": "skip"},
        {"event": "corruption", "step": "x", "ranks": "?", "nodes": None},  # torn by hand: "?", no exception
        {"event": "corruption", "step": 30, "kind": "batch", "ranks": [], "nodes": [], "rolled_back_to": 25,
         "steps_replayed": 4, "action": "step 27's batch skipped",
         "batch": {"step": 27, "epoch": 0, "consumed": 416, "count": 16, "indices": list(range(9))}},
        {"event": "corruption", "step": 30, "kind": "batch", "batch": {"indices": "x", "consumed": True}},
        {"event": "numeric", "step": 7, "why": "non-finite loss", "value": math.nan, "action": "skip", "kind": "batch"},
    ]
    assert report.lines(events) == [
        ("corruption found at step 15: transient (rank 1 on node 1 (b)); rolled back to step 10, 5 step(s) replayed: "
        "rolled back to step 10 and replayed 5 step(s)"),
        "numeric fault at step 18: non-finite loss (nan) caught before the update: skip",
        "corruption found at step ?: ? (no rank named); rolled back to step ?, ? step(s) replayed: ?",
        ("corruption found at step 30: batch (no rank named); rolled back to step 25, 4 step(s) replayed: step 27's "
        "batch skipped; the batch of step 27 (epoch 0, positions 416-431 of its stream), suspect samples "
        "[0, 1, 2, 3, 4, 5, 6, 7, ...]"),
        ("corruption found at step 30: batch (no rank named); rolled back to step ?, ? step(s) replayed: ?; the batch "
        "of step ? (epoch ?, positions ? of its stream), suspect samples [?]"),
        ("numeric fault at step 7: non-finite loss (nan) caught before the update: skip (caught again on its replay: "
        "the batch)"),
    ]
    assert report.detection(events, 12) == (3, 1.75)
    assert report.detection(events, 20) is None


def test_the_metrics_count_corruptions_replays_and_numeric_faults() -> None:
    from elastic._worker.observe.metrics import TrainingMetrics

    metrics = TrainingMetrics(rank=0, run_id="r", restarts=0, world_size=3, samples_per_step=8)
    metrics.observe({"event": "corruption", "step": 15, "steps_replayed": 5})
    metrics.observe({"event": "corruption", "step": 30, "steps_replayed": "five"})  # a bad field adds nothing
    metrics.observe({"event": "numeric", "step": 18})

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(f"torchrevive_{name}", {"rank": "0", "run_id": "r"})

    assert (value("corruptions_total"), value("steps_replayed_total"), value("numeric_faults_total")) == (2, 5, 1)


def test_a_worker_that_proved_its_node_wrong_gets_it_set_aside_at_once() -> None:
    from elastic._agent.launcher.failure_policy import Failure, decide
    from elastic._shared.protocol.exit_status import FAULTY_NODE_EXIT
    from elastic._worker.integrity.replica_check import FaultyNodeError

    assert FaultyNodeError("x").exit_code == FAULTY_NODE_EXIT

    def failure(node: str, exitcode: int, time: float) -> Failure:
        return Failure(rank=1, node=node, host="h", exitcode=exitcode, step=15, error="diverged", time=time, primary=True)

    settings = {"now": 10.0, "limit": 3, "window": 600.0, "attempts": 3}
    proven = decide([failure("b", FAULTY_NODE_EXIT, 9.0)], [], can_shrink=True, **settings)
    assert proven.kind == "set_aside" and proven.node == "b" and "diverged from its replicas" in proven.line
    assert decide([failure("b", 1, 9.0)], [], can_shrink=True, **settings).kind == "restart"  # one crash: a strike
    assert decide([failure("b", FAULTY_NODE_EXIT, 9.0)], [], can_shrink=False, **settings).kind == "restart"
