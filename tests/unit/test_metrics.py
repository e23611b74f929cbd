"""Worker metrics: fed from the event stream, served over HTTP, never fatal."""

from __future__ import annotations

import logging

import pytest
from support import context, free_port, samples

from elastic._worker.observe.events import EventLog
from elastic._worker.observe.metrics import (
    METRICS,
    PREFIX,
    TrainingMetrics,
    start_metrics,
)


def test_steps_checkpoints_restores_and_evals_update_the_metrics() -> None:
    metrics = TrainingMetrics(rank=0, run_id="job7", restarts=2, world_size=4, samples_per_step=8, tokens_per_sample=32)
    log = EventLog(None, restart=2)
    log.subscribe(metrics.observe)
    log.emit("restore", step=40, world_size=4, time=100.0, seconds=0.75, checkpoint="step_00000040")
    log.emit("start", step=40, world_size=4, time=100.5)
    log.emit("step", step=41, world_size=4, time=101.0, loss=2.5)  # 0.5 s after the start
    log.emit("step", step=42, world_size=4, time=101.25, loss=2.25)
    log.emit("checkpoint", step=42, world_size=4, time=102.0, seconds=0.5, blocking_seconds=0.002)
    log.emit("eval", step=42, world_size=4, time=110.0, val_loss=2.0, accuracy=0.5)
    log.emit("step", step=43, world_size=4, time=110.5, loss=2.0)  # validation time is not step time
    got = samples(metrics)
    assert got["torchrevive_step"] == 43
    assert got["torchrevive_loss"] == 2.0
    assert got["torchrevive_last_step_timestamp_seconds"] == 110.5
    assert got["torchrevive_samples_total"] == 3 * 8 and got["torchrevive_tokens_total"] == 3 * 8 * 32
    assert got["torchrevive_samples_per_second"] == 8 / 0.5 and got["torchrevive_tokens_per_second"] == 8 * 32 / 0.5
    assert got["torchrevive_step_duration_seconds_count"] == 3
    assert got["torchrevive_step_duration_seconds_sum"] == pytest.approx(0.5 + 0.25 + 0.5)
    assert got["torchrevive_checkpoint_blocking_seconds_sum"] == 0.002
    assert got["torchrevive_checkpoint_write_seconds_sum"] == 0.5
    assert got["torchrevive_checkpoint_last_step"] == 42
    assert got["torchrevive_restore_seconds"] == 0.75 and got["torchrevive_restored_step"] == 40
    assert got["torchrevive_eval{metric=val_loss}"] == 2.0 and got["torchrevive_eval{metric=accuracy}"] == 0.5
    assert got["torchrevive_restarts"] == 2 and got["torchrevive_world_size"] == 4


@pytest.mark.parametrize("rank", [0, 3])
def test_every_listed_metric_is_exported_with_rank_and_run_id(rank: int) -> None:
    metrics = TrainingMetrics(rank=rank, run_id="job7", restarts=0, world_size=4, samples_per_step=8)
    log = EventLog(None, restart=0)
    log.subscribe(metrics.observe)
    log.emit("eval", step=0, world_size=4, val_loss=1.0)
    families = {f.name: f for f in metrics.registry.collect()}
    for name, (kind, _) in METRICS.items():
        family = families.get(f"{PREFIX}_{name}".removesuffix("_total"))
        if name.startswith("checkpoint_") and rank != 0:
            assert family is None, "only rank 0 commits checkpoints"
            continue
        assert family.type == kind and family.documentation
        assert all(s.labels["rank"] == str(rank) and s.labels["run_id"] == "job7" for s in family.samples), name






def test_an_address_that_cannot_be_bound_is_a_warning_too(caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog(None, restart=0)
    with caplog.at_level(logging.WARNING, logger="elastic._worker.observe.metrics"):
        with start_metrics(context(), log, port=free_port(), host="a" * 300, samples_per_step=4) as metrics:
            log.emit("step", step=1, world_size=4, loss=1.0)
    assert metrics.address is None and "without a metrics endpoint" in caplog.text


def test_port_zero_serves_nothing_and_subscribes_nothing() -> None:
    log = EventLog(None, restart=0)
    with start_metrics(context(), log, port=0, samples_per_step=4) as metrics:
        log.emit("step", step=5, world_size=4, loss=1.0)
    assert metrics.address is None and samples(metrics)["torchrevive_step"] == 0


def test_a_failing_listener_is_dropped_and_the_log_keeps_writing(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    seen = []

    def broken(record: dict) -> None:
        seen.append(record["step"])
        raise RuntimeError("boom")

    with EventLog(tmp_path / "e.jsonl", restart=0) as log:
        log.subscribe(broken)
        log.emit("step", step=1, world_size=1, loss=1.0)
        log.emit("step", step=2, world_size=1, loss=1.0)
    assert seen == [1], "dropped after its first failure"
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == 2
    assert "boom" in caplog.text
