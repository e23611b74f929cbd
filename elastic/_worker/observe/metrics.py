"""Prometheus metrics of a training worker (`--metrics-port`, `--metrics-host`).

Every worker serves its own `/metrics` over HTTP on port `--metrics-port` +
LOCAL_RANK, so the workers of one node never collide and a scrape config lists
`base .. base + nproc_per_node - 1` per node. The address defaults to loopback:
the endpoint has no authentication and reveals the job's progress, so it is
exposed beyond the machine only when the user names an address
(`--metrics-host 0.0.0.0` in a pod, where the scraper comes from outside).

Invariants:
- Metrics are fed from the event log's stream (`EventLog.subscribe`), on every
  rank, so they agree with the JSON-lines history and cost the hot path only
  what the recipe already computes: the loss it reads one step late, a clock
  read, a few lock-protected number updates. Never a device sync.
- Every series carries the labels `rank` and `run_id` (TORCHELASTIC_RUN_ID).
  Rates and throughputs are this rank's; `sum by (run_id)` gives the job's.
  The checkpoint series exist on rank 0 only, the rank that commits them.
- A metrics failure never stops training: a port already taken (or an address
  that cannot be bound) is one WARNING line naming the address and port, and
  that worker trains without an endpoint.
- Each worker has its own registry: nothing is shared through
  prometheus_client's global one, so a warm-started worker forked from a server
  that imported it starts clean.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from elastic._shared.protocol import worker_notes
from elastic._worker.config import DEFAULT_METRICS_HOST
from elastic._worker.observe.events import EventLog
from elastic._worker.runtime.context import WorkerContext

logger = logging.getLogger(__name__)

PREFIX = "torchrevive"
LABELS = ("rank", "run_id")

# Step times from a few ms (a small model on a GPU) to a minute (a huge one, or a stall).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Checkpoint times from a snapshot that barely blocks to a slow shared filesystem.
CHECKPOINT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# Series only rank 0 exports: it alone commits checkpoints.
COMMITTER_ONLY = "checkpoint_"

# Fields of an eval event that are not a measured value.
_EVENT_FIELDS = {"event", "time", "step", "world_size", "restart"}

# name (without prefix) -> (kind, help). docs/metrics.md's metrics table and the
# Grafana dashboard are checked against this list by the tests.
METRICS: dict[str, tuple[str, str]] = {
    "step": ("gauge", "Optimizer steps the job has completed (the global step; restored on restart)."),
    "samples_total": ("counter", "Samples this rank trained on since the worker started."),
    "tokens_total": ("counter", "Tokens this rank trained on since the worker started (0 for non-token models)."),
    "samples_per_second": ("gauge", "This rank's samples per second over the last step."),
    "tokens_per_second": ("gauge", "This rank's tokens per second over the last step."),
    "step_duration_seconds": ("histogram", "Wall time of one training step, end to end."),
    "loss": ("gauge", "Training loss of the last step."),
    "eval": ("gauge", "Last evaluation result, one series per measured value (label metric)."),
    "last_step_timestamp_seconds": ("gauge", "Unix time the last step completed (time() - this = stall)."),
    "checkpoint_blocking_seconds": ("histogram", "Seconds the training loop blocked per checkpoint (rank 0)."),
    "checkpoint_write_seconds": ("histogram", "Seconds from a checkpoint's start to its commit, mostly in the background (rank 0)."),
    "checkpoint_last_step": ("gauge", "Step of the newest committed checkpoint (-1: none yet)."),
    "checkpoint_failures_total": ("counter", "Checkpoints that failed to write (full disk, I/O errors); training went on (rank 0)."),
    "checkpoint_skipped_total": ("counter", "Periodic checkpoints skipped because the previous one was still being written (rank 0)."),
    "restarts": ("gauge", "Times the agent restarted this worker group after failures (TORCHELASTIC_RESTART_COUNT)."),
    "world_size": ("gauge", "Workers in the job in this rendezvous round."),
    "restore_seconds": ("gauge", "Seconds this worker spent loading the checkpoint it resumed from (0: fresh start)."),
    "restored_step": ("gauge", "Step this worker resumed from (0: fresh start)."),
    "watchdog_timeout_seconds": ("gauge", "Hang watchdog limit: a stall this long ends the worker (0: watchdog off)."),
    "job_failures": ("gauge", ("Workers of the job that failed first (not of a peer's failure), as this node's agent "
                               "has read them (torchrevive-run).")),
    "job_hangs_named": ("gauge", "Hangs of the job whose culprit the ranks named, as this node's agent has read them."),
    "nodes_set_aside": ("gauge", "Nodes the job has set aside (too many failures while the others stayed healthy)."),
    "corruptions_total": ("counter", "Replica checks that found the ranks' parameters differ (each undone by a rollback)."),
    "steps_replayed_total": ("counter", "Steps trained again after rolling back to the last passing replica check."),
    "numeric_faults_total": ("counter", "Steps the numeric guard caught before their update (non-finite or spiking)."),
    "rank_slowdown": ("gauge", "This rank's work per sample over the other ranks' median while it is a straggler (0: not one)."),
}
NOTED = ("job_failures", "job_hangs_named", "nodes_set_aside")
"""Series read at each scrape from this node's agent's note (elastic._shared.protocol.worker_notes), not
from the worker's own events: the agents, not the workers, learn of the job's failures."""


class LabelledProcessCollector:
    """prometheus_client's process metrics with this worker's `rank` and `run_id` labels.

    Without them the process series of the workers of one pod (or of two jobs)
    could not be told apart, and a dashboard filtering on rank would drop them.
    """

    def __init__(self, labels: dict[str, str]) -> None:
        self._inner = ProcessCollector(registry=None)
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(sample.name, {**sample.labels, **self._labels}, sample.value, sample.timestamp)
            yield labelled


class AgentNotesCollector:
    """The `NOTED` series: the counts this node's agent keeps in its note (0 without an agent that notes).
    `directory`: the agent's notes folder (`WorkerEnv.notes_dir`), None without one."""

    def __init__(self, labels: dict[str, str], directory: str | None = None) -> None:
        self._labels = labels
        self._directory = directory

    def collect(self) -> Iterator[Metric]:
        counts = worker_notes.read_incidents(self._directory) if self._directory else {}
        for name in NOTED:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", METRICS[name][1], labels=LABELS)
            family.add_metric([self._labels["rank"], self._labels["run_id"]], counts.get(name, 0))
            yield family


class TrainingMetrics:
    """One worker's metrics, updated from its event stream; `serve()` exposes them."""

    def __init__(
        self,
        *,
        rank: int,
        run_id: str,
        restarts: int,
        world_size: int,
        samples_per_step: int,
        tokens_per_sample: int = 0,
        watchdog_timeout: float = 0.0,
        notes_dir: str | None = None,
    ) -> None:
        """`notes_dir`: the agent's notes folder (`WorkerEnv.notes_dir`), where the job's counts are read."""
        # The *_created series would double what a scrape carries and say nothing here
        # (the process start time is in process_start_time_seconds).
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self._samples_per_step = samples_per_step
        self._tokens_per_sample = tokens_per_sample
        labels = {"rank": str(rank), "run_id": run_id}
        self._rank = rank
        self._m: dict[str, Any] = {}
        for name, (kind, doc) in METRICS.items():
            if name.startswith(COMMITTER_ONLY) and rank != 0:
                continue  # only rank 0 commits checkpoints: elsewhere the series would be a constant lie
            if name in NOTED:
                continue  # read at each scrape (AgentNotesCollector)
            full = f"{PREFIX}_{name}"
            if kind == "counter":
                metric = Counter(full.removesuffix("_total"), doc, LABELS, registry=self.registry)
            elif kind == "histogram":
                buckets = STEP_BUCKETS if name.startswith("step") else CHECKPOINT_BUCKETS
                metric = Histogram(full, doc, LABELS, buckets=buckets, registry=self.registry)
            elif name == "eval":
                metric = Gauge(full, doc, (*LABELS, "metric"), registry=self.registry)
            else:
                metric = Gauge(full, doc, LABELS, registry=self.registry)
            # Bind the labels once: an update is then a lock and an add, no dict lookups.
            self._m[name] = metric if name == "eval" else metric.labels(**labels)
        self._labels = labels
        self.registry.register(LabelledProcessCollector(labels))  # process_cpu_seconds_total, memory, ...
        self.registry.register(AgentNotesCollector(labels, notes_dir))  # the job's failures, hangs, nodes set aside
        self._m["restarts"].set(restarts)
        self._m["world_size"].set(world_size)
        self._m["watchdog_timeout_seconds"].set(watchdog_timeout)
        if rank == 0:
            self._m["checkpoint_last_step"].set(-1)
        self._last_time: float | None = None
        self._last_step: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

    # -- event stream -------------------------------------------------------------

    def observe(self, record: dict[str, Any]) -> None:
        """An `EventLog` listener: update from one event."""
        kind = record["event"]
        if kind == "step":
            self._on_step(record)
        elif kind == "checkpoint" and "checkpoint_last_step" in self._m:
            self._m["checkpoint_blocking_seconds"].observe(record.get("blocking_seconds", 0.0))
            self._m["checkpoint_write_seconds"].observe(record.get("seconds", 0.0))
            self._m["checkpoint_last_step"].set(record["step"])
        elif kind == "checkpoint_failed" and "checkpoint_failures_total" in self._m:
            self._m["checkpoint_failures_total"].inc()
        elif kind == "checkpoint_skipped" and "checkpoint_skipped_total" in self._m:
            self._m["checkpoint_skipped_total"].inc()
        elif kind == "corruption":
            self._m["corruptions_total"].inc()
            replayed = record.get("steps_replayed")
            if isinstance(replayed, int) and not isinstance(replayed, bool) and replayed > 0:
                self._m["steps_replayed_total"].inc(replayed)
        elif kind == "numeric":
            self._m["numeric_faults_total"].inc()
        elif kind in ("straggler", "straggler_recovered") and record.get("rank") == self._rank:
            slowdown = record.get("slowdown")
            started = kind == "straggler" and isinstance(slowdown, (int, float)) and not isinstance(slowdown, bool)
            self._m["rank_slowdown"].set(slowdown if started else 0.0)
        elif kind == "restore":
            self._m["restore_seconds"].set(record.get("seconds", 0.0))
            self._m["restored_step"].set(record["step"])
            self._m["step"].set(record["step"])
            self._restart_clock(record)
        elif kind == "start":
            self._m["world_size"].set(record["world_size"])
            self._m["step"].set(record["step"])
            self._restart_clock(record)
        elif kind == "eval":
            for field, value in record.items():
                if field not in _EVENT_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._m["eval"].labels(**self._labels, metric=field).set(value)
            # Validation is not a training step: the next step's time starts here.
            self._restart_clock(record)

    def _restart_clock(self, record: dict[str, Any]) -> None:
        self._last_time, self._last_step = record["time"], record["step"]

    def _on_step(self, record: dict[str, Any]) -> None:
        now, step = record["time"], record["step"]
        m = self._m
        m["step"].set(step)
        m["last_step_timestamp_seconds"].set(now)
        if "loss" in record:
            m["loss"].set(record["loss"])
        steps = step - self._last_step if self._last_step is not None else 1
        m["samples_total"].inc(self._samples_per_step * steps)
        m["tokens_total"].inc(self._samples_per_step * self._tokens_per_sample * steps)
        if self._last_time is not None and steps > 0 and now > self._last_time:
            per_step = (now - self._last_time) / steps
            m["step_duration_seconds"].observe(per_step)
            samples_per_second = self._samples_per_step / per_step
            m["samples_per_second"].set(samples_per_second)
            m["tokens_per_second"].set(samples_per_second * self._tokens_per_sample)
        self._last_time, self._last_step = now, step

    # -- endpoint -----------------------------------------------------------------

    def serve(self, host: str, port: int) -> bool:
        """Serve /metrics on host:port; False (after one warning) when that is impossible."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except Exception as exc:  # noqa: BLE001 - a taken port, a bad address: never fatal to training
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            logger.warning(
                "metrics: cannot serve on %s:%d (rank %s): %s; this worker trains without a metrics endpoint",
                host, port, self._labels["rank"], reason,
            )
            return False
        self.address = (host, self._server.server_port)
        logger.info("metrics: serving http://%s:%d/metrics", host, self._server.server_port)
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> TrainingMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics(
    ctx: WorkerContext,
    events: EventLog,
    *,
    port: int,
    host: str = DEFAULT_METRICS_HOST,
    samples_per_step: int,
    tokens_per_sample: int = 0,
    watchdog: object | None = None,
) -> TrainingMetrics:
    """The worker's metrics, subscribed to `events` and served on `port` + local rank.

    `port` 0 turns metrics off: nothing is subscribed, nothing served.
    `samples_per_step` is this rank's batch. Use as a context manager, so the
    endpoint closes when training ends.
    """
    metrics = TrainingMetrics(
        rank=ctx.rank, run_id=ctx.run_id, restarts=ctx.restart_count, world_size=ctx.world_size,
        samples_per_step=samples_per_step, tokens_per_sample=tokens_per_sample,
        watchdog_timeout=float(getattr(watchdog, "timeout", 0.0)), notes_dir=ctx.env.notes_dir,
    )
    if not port:
        return metrics
    events.subscribe(metrics.observe)
    worker_port = port + ctx.local_rank
    if worker_port > 65535:
        logger.warning(
            "metrics: port %d + local rank %d is past 65535; this worker trains without a metrics endpoint",
            port, ctx.local_rank,
        )
    else:
        metrics.serve(host, worker_port)
    return metrics

