"""Worker metrics served over HTTP: on the port asked for plus the local rank, and a taken port is no failure."""

from __future__ import annotations

import logging
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import context, free_port, samples

from elastic._worker.observe.events import EventLog
from elastic._worker.observe.metrics import start_metrics


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_a_worker_serves_its_metrics_on_base_port_plus_local_rank(caplog: pytest.LogCaptureFixture) -> None:
    base = free_port()
    log = EventLog(None, restart=2)
    with start_metrics(context(local_rank=0), log, port=base, samples_per_step=4) as metrics:
        assert metrics.address == ("127.0.0.1", base)
        log.emit("step", step=7, world_size=4, loss=1.5)
        families = {f.name: f for f in text_string_to_metric_families(scrape(base))}
    (step,) = families["torchrevive_step"].samples
    assert step.value == 7 and step.labels == {"rank": "1", "run_id": "job7"}
    assert "process_resident_memory_bytes" in families, "process metrics come along"
    for family in families.values():
        for s in family.samples:
            assert s.labels.get("rank") == "1" and s.labels.get("run_id") == "job7", s.name
    with pytest.raises(OSError):
        scrape(base)  # closed with the context


def test_a_taken_port_is_one_warning_naming_it_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = EventLog(None, restart=0)
        with caplog.at_level(logging.WARNING, logger="elastic._worker.observe.metrics"):
            with start_metrics(context(), log, port=port, samples_per_step=4) as metrics:
                log.emit("step", step=1, world_size=4, loss=1.0)  # the stream still flows
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"127.0.0.1:{port}" in warning.getMessage() and "without a metrics endpoint" in warning.getMessage()
    assert metrics.address is None
    assert samples(metrics)["torchrevive_step"] == 1
