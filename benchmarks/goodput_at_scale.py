"""Goodput at 1,000, 10,000 and 100,000 GPUs under published failure rates: an analytic model, no training.

    python benchmarks/goodput_at_scale.py                       # the tables, well under a second
    python benchmarks/goodput_at_scale.py --json goodput.json --plot goodput.png
    python benchmarks/goodput_at_scale.py --measured measured.json --recovery-ours-s 4.1

Goodput is the fraction of wall-clock time a job spends making progress it
keeps. Three systems side by side:

- stock: `torchrun` + checkpoint-restart. Every failure restarts the job with
  stock torchrun's recovery time plus a restart at scale; a durable checkpoint
  every C minutes blocks the loop for a synchronous save. A second row runs
  it at its Young/Daly interval instead of C, so the comparison is not
  against a badly tuned torchrun.
- today: torchrevive as it is: our launcher's recovery time, asynchronous
  durable checkpoints every C minutes (the loop blocks for a fraction of a
  synchronous save); a failure loses on average half an interval.
- snapshots: torchrevive + in-memory snapshots at their default interval
  (`--snapshot-every auto`): the state is copied into host memory every S
  seconds, S being as often as 1 % of the loop buys at the copy's cost (the
  state over PCIe: state_gb_per_gpu / pcie_gbps_per_gpu), in whole steps, at
  most Young/Daly's for that cost and the job's MTBF, at least a step and at
  most C, as the runtime picks it; a failure redoes on average half of
  S and restores from memory. Durable checkpoints still every C minutes. The
  snapshot is assumed to survive the failure (a copy on another host); a
  failure that takes out both copies falls back to the durable checkpoint
  and is not modelled.
- in place: torchrevive with heals in place (TORCHREVIVE_SURVIVORS=keep):
  the survivors keep their processes and their state; the failed worker's
  replacement takes the state of the last completed step from a live peer over
  the network (state_gb_per_gpu at peer_gbps_per_gpu) while every other GPU
  waits, and the void step is trained again. No rendezvous round: the process
  group is rebuilt (regroup_at_scale_s). Everyone also waits for the
  replacement process to start (worker_start_at_scale_s). Snapshots and
  durable checkpoints still run, as in the row above.
- train on: torchrevive with the survivors training on
  (TORCHREVIVE_SURVIVORS=train-on): the survivors rebuild a smaller group at
  once and train on without the failed replica (replica_gpus of the job's N
  GPUs) while its replacement starts; then the job stops once more while the
  replacement joins (the group rebuilt again and the state sent to it). A
  lost node leaves it training on too, where the rows above fall back to a
  restart; not modelled.

Both torchrevive rows also pay loop_overhead on every step: the end-to-end
cost of the runtime on the loop, 1 - the ratio `benchmarks/overhead.py`
measures against a plain DDP loop with default settings (`--json` there
writes it in the form `--measured` reads). That figure already holds the
benchmark's own CPU snapshots, so the snapshots row counts them twice: a
bound, not an estimate.

The model (first order, as Young and Daly's; every time in seconds):

    λ(N)        = r × N / 3600          failures per second of an N-GPU job; r per GPU-hour, from
                                        a published source; failures independent per GPU
    MTBF(N)     = 1 / λ(N)
    C           = 60 × checkpoint_interval_min
    restore_disk = max(restore_disk_s, state_gb_per_gpu / storage_gbps_per_gpu)
    async_stall = async_stall_ratio × sync_stall_s

    E[lost per failure] = recovery + restore + lost work, where
      stock:      (recovery_stock_s + restart_at_scale_s) + restore_disk      + C / 2
      today:      (recovery_ours_s + rendezvous_at_scale_s + worker_start_at_scale_s) + restore_disk + C / 2
      snapshots:  (recovery_ours_s + rendezvous_at_scale_s + worker_start_at_scale_s) + restore_memory_s + S / 2
      in place:   (recovery_in_place_s + regroup_at_scale_s + worker_start_at_scale_s)
                  + state / peer_gbps + step_s
      train on:   (recovery_train_on_s + regroup_at_scale_s)
                  + (join_pause_s + regroup_at_scale_s + state / peer_gbps)
                  + step_s + min(1, replica_gpus / N) × worker_start_at_scale_s
    (the measured recovery times run from the kill to the first step of the
    restarted group: they include detection and rendezvous at 2 agents)

    snapshot_s  = state_gb_per_gpu / pcie_gbps_per_gpu      one snapshot's copy, charged whole to the loop
    S           = min(C, max(step_s, min(ceil(snapshot_s / (0.01 step_s)) step_s, Daly(snapshot_s, MTBF))))

    steady overhead:
      stock:      sync_stall_s / C
      today:      loop_overhead + async_stall / C
      snapshots:  loop_overhead + async_stall / C + snapshot_s / S
      in place, train on: as snapshots

    goodput = max(0, (1 - steady overhead) × (1 - λ × E[lost per failure]))

    Young/Daly (stock): C* = max(step_s, sqrt(2 × sync_stall_s × MTBF)), then the
    stock formulas with C* for C.


Failure rates per GPU (r), each scaled linearly to N:

- llama3: Meta, "The Llama 3 Herd of Models" (2024): 419 unexpected
  interruptions in 54 days of Llama 3 405B pre-training on 16,384 GPUs:
  r = 419 / (54 × 24 × 16,384).
- meta-rsc-1k, meta-rsc-16k: Kokolis et al., "Revisiting Reliability in
  Large-Scale Machine Learning Research Clusters" (2024, HPCA 2025): job mean
  time to failure 7.9 h at 1,024 GPUs and 1.8 h at 16,384 GPUs:
  r = 1 / (7.9 × 1,024) and r = 1 / (1.8 × 16,384). The two anchors do not
  agree under linear scaling: 7.9 h at 1,024 GPUs scales to 0.49 h at
  16,384, not 1.8 h (failures are not independent per GPU, or the job mix
  differs), so both are kept, as two sources; each reproduces its own anchor.
- ant: Ant Group: 0.27 % of GPUs fail per day: r = 0.0027 / 24.
The figures are as the issue quotes them; they were not re-checked against
the papers here.

Two defaults deserve a warning. sync_stall_s (60 s) is an assumption:
writing state_gb_per_gpu at storage_gbps_per_gpu alone takes 4 s, and stock's
steady overhead (stall / C: 10 % at 60 s, 0.7 % at 4 s) follows it directly;
try `--sync-stall-s 4`. pcie_gbps_per_gpu (25 GB/s) is an assumption too:
PCIe 4.0 x16 carries 31.5 GB/s each way by its specification (PCI-SIG), and
pinned device-to-host copies reach about 80 % of that; no GPU measured it here.

Where λ × E[lost per failure] > 0.2 (failures less than five times as far
apart as each costs) the first-order model is outside its range (it ignores
failures during recovery and during redone work): such cells carry a `*`
and read as "collapses", not as a figure.

Every input is measured by this repository's benchmarks (README figures),
an assumption, or a target of the in-memory snapshots; each is printed with
its value and source. Each can be set by its flag or from `--measured
FILE.json`, whose keys are the flag names with underscores (flags win over
the file). `--json FILE` writes every result; `--plot FILE.png` draws goodput
against GPUs (log x) per system under the Meta research-cluster rates.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name
from common import fail  # noqa: E402
from provenance import write_result  # noqa: E402

PROG = "goodput_at_scale.py"
GPUS = (1_000, 10_000, 100_000)
FIRST_ORDER_LIMIT = 0.2  # λ × E[lost per failure] above which a cell is marked


@dataclass(frozen=True)
class Param:
    default: float
    unit: str
    kind: str  # "measured" (here, by the benchmarks), "assumption" or "target" (the in-memory snapshots)
    source: str
    positive: bool = False  # must be > 0, not only >= 0
    fraction: bool = False  # must be < 1


PARAMS: dict[str, Param] = {
    "recovery_ours_s": Param(
        0.75, "s", "measured",
        "benchmarks/recovery.py: torchrevive-run, median SIGKILL -> first step of the restarted group, "
        "2 agents on one host (README, torch 2.14); includes detection, a quick rendezvous round, the "
        "workers' warm start and a restore from memory"),
    "recovery_in_place_s": Param(
        0.4, "s", "measured",
        "benchmarks/recovery.py --settings ours,ours-keep: torchrevive-run with TORCHREVIVE_SURVIVORS=keep, median "
        "SIGKILL -> first step after the heal, 2 agents on one host (README); includes detection, the group's "
        "rebuild and the replacement's catch-up from a live peer (a small model)"),
    "recovery_stock_s": Param(
        34.8, "s", "measured", "benchmarks/recovery.py, same run: stock torchrun with its defaults (README)"),
    "restore_memory_s": Param(
        2.3, "s", "measured",
        "benchmarks/snapshot_restore.py: restore of a 1.1 GB state (~100M-parameter model with AdamW) from "
        "the node's shared memory, one process, crc32c checked (README; 0.03 s for the recipe model)"),
    "restore_disk_s": Param(
        5.6, "s", "measured",
        "benchmarks/checkpoint.py: sharded restore of a 1.2 GB state, 4 ranks DDP, fresh processes (README)"),
    "checkpoint_interval_min": Param(
        10.0, "min", "assumption", "the issue's 10-minute checkpoint interval", positive=True),
    "sync_stall_s": Param(
        60.0, "s", "assumption",
        "loop blocked per synchronous durable save at scale (stock); see the bandwidth-only figure below"),
    "async_stall_ratio": Param(
        0.063, "", "measured",
        "benchmarks/checkpoint.py: loop blocked per async save / synchronous torch.save, recipe model "
        "(README; 0.0047 for the ~100M GPT)"),
    "loop_overhead": Param(
        0.0, "", "measured",
        "benchmarks/overhead.py: 1 - (recipe with default settings / seed-style DDP loop), 1/median step, 2 ranks "
        "on CPU: 1.006 [95 % CI 0.998-1.014] in 60 blocks, a ratio above 1 counts as 0 (README; 0.995 with metrics "
        "served and scraped every second; its --json writes the figure for --measured)",
        fraction=True),
    "pcie_gbps_per_gpu": Param(
        25.0, "GB/s", "assumption",
        "device-to-pinned-host copy bandwidth per GPU: PCIe 4.0 x16, 31.5 GB/s each way (PCI-SIG), ~80 % achieved",
        positive=True),
    "step_s": Param(1.0, "s", "assumption", "seconds per training step at scale", positive=True),
    "state_gb_per_gpu": Param(2.0, "GB", "assumption", "model and optimizer state per GPU (sharded)"),
    "storage_gbps_per_gpu": Param(
        0.5, "GB/s", "assumption", "durable storage bandwidth per GPU, write and read", positive=True),
    "restart_at_scale_s": Param(
        60.0, "s", "assumption",
        "stock only: job restart at 10,000+ GPUs (relaunch, rendezvous and process-group setup at scale), "
        "added at every scale"),
    "rendezvous_at_scale_s": Param(
        10.0, "s", "assumption", "ours only: rendezvous and process-group setup at scale, added at every scale"),
    "regroup_at_scale_s": Param(
        5.0, "s", "assumption", "in place only: the process group's rebuild at scale (no rendezvous round)"),
    "recovery_train_on_s": Param(
        0.2, "s", "measured",
        "benchmarks/recovery.py --settings ours-train-on: torchrevive-run with TORCHREVIVE_SURVIVORS=train-on, "
        "median SIGKILL -> first step of the survivors' smaller group, 2 agents on one host (README); includes "
        "detection and the group's rebuild, no catch-up"),
    "join_pause_s": Param(
        0.15, "s", "measured",
        "benchmarks/recovery.py --settings ours-train-on: median seconds the job stood still while the "
        "replacement joined (the group formed again with it and the state sent to it), small model (README)"),
    "worker_start_at_scale_s": Param(
        30.0, "s", "assumption",
        "ours: a worker process at scale (interpreter, CUDA and NCCL initialisation, model build) before it "
        "can take the state: a restart pays it for every worker (today, snapshots; stock's restart_at_scale_s "
        "holds it), keep waits for the replacement's, train-on trains on meanwhile"),
    "replica_gpus": Param(
        8.0, "GPUs", "assumption",
        "train on only: GPUs one failure takes out of the data-parallel width while the replacement starts "
        "(a node of tensor parallelism)", positive=True),
    "peer_gbps_per_gpu": Param(
        4.0, "GB/s", "assumption",
        "in place only: a replacement's catch-up from a live peer over the network (torchft reports about "
        "4 GB/s for its HTTP transport)", positive=True),
}


@dataclass(frozen=True)
class Source:
    key: str
    label: str
    citation: str
    per_gpu_hour: float  # failures per GPU-hour
    anchor_gpus: int
    anchor_mtbf_h: float | None  # the published job MTBF at anchor_gpus, where there is one


SOURCES = (
    Source("llama3", "Llama 3 (Meta, 2024)",
           'Meta, "The Llama 3 Herd of Models" (2024): 419 unexpected interruptions in 54 days on 16,384 GPUs',
           419 / (54 * 24 * 16_384), 16_384, 54 * 24 / 419),
    Source("meta-rsc-1k", "Meta research clusters, 1,024-GPU anchor",
           'Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters" (2024): '
           "MTTF 7.9 h at 1,024 GPUs",
           1 / (7.9 * 1_024), 1_024, 7.9),
    Source("meta-rsc-16k", "Meta research clusters, 16,384-GPU anchor",
           "Kokolis et al. (2024), same paper: MTTF 1.8 h at 16,384 GPUs",
           1 / (1.8 * 16_384), 16_384, 1.8),
    Source("ant", "Ant Group", "Ant Group: 0.27 % of GPUs fail per day", 0.0027 / 24, 1, None),
)
PLOT_SOURCES = ("meta-rsc-16k", "meta-rsc-1k")

SYSTEMS = {
    "stock": "torchrun + checkpoint-restart",
    "stock_daly": "torchrun, Young/Daly interval",
    "today": "torchrevive today",
    "snapshots": "torchrevive + in-memory snapshots",
    "in_place": "torchrevive, survivors heal in place",
    "train_on": "torchrevive, survivors train on",
}


# --- the model -------------------------------------------------------------------------------------------------


def mtbf_s(source: Source, gpus: int) -> float:
    """Mean time between failures of an N-GPU job: failures independent per GPU, rate ∝ N."""
    return 3600.0 / (source.per_gpu_hour * gpus)


def restore_disk_at_scale_s(p: dict[str, float]) -> float:
    return max(p["restore_disk_s"], p["state_gb_per_gpu"] / p["storage_gbps_per_gpu"])


def young_daly_interval_s(p: dict[str, float], mtbf: float) -> float:
    """Young/Daly's checkpoint interval for the synchronous stall; no shorter than a step."""
    return max(p["step_s"], math.sqrt(2 * p["sync_stall_s"] * mtbf))


def snapshot_cost_s(p: dict[str, float]) -> float:
    return p["state_gb_per_gpu"] / p["pcie_gbps_per_gpu"]


SNAPSHOT_BUDGET = 0.01
"""The share of the loop auto's snapshots may cost (elastic/_worker/checkpoint/snapshot_interval.py's BUDGET)."""


def snapshot_interval_s(p: dict[str, float], interval_s: float, mtbf: float) -> float:
    """The runtime's auto interval: as often as the budget buys (whole steps), at most Daly's for the
    snapshot's cost, at least a step, at most C."""
    cost = snapshot_cost_s(p)
    if cost >= 2 * mtbf:
        daly = mtbf
    else:
        ratio = cost / (2 * mtbf)
        daly = math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost
    budget = max(1, math.ceil(cost / (SNAPSHOT_BUDGET * p["step_s"]) - 1e-9)) * p["step_s"]
    return min(interval_s, max(p["step_s"], min(budget, daly)))


def per_failure(
    system: str, p: dict[str, float], interval_s: float, mtbf: float = math.inf, gpus: float = math.inf
) -> dict[str, float]:
    """Seconds one failure costs, split into recovery (detection, restart, rendezvous), restore and redone work."""
    if system in ("stock", "stock_daly"):
        recovery, restore = p["recovery_stock_s"] + p["restart_at_scale_s"], restore_disk_at_scale_s(p)
        lost_work = interval_s / 2
    elif system == "today":
        recovery = p["recovery_ours_s"] + p["rendezvous_at_scale_s"] + p["worker_start_at_scale_s"]
        restore = restore_disk_at_scale_s(p)
        lost_work = interval_s / 2
    elif system == "snapshots":
        recovery = p["recovery_ours_s"] + p["rendezvous_at_scale_s"] + p["worker_start_at_scale_s"]
        restore = p["restore_memory_s"]
        lost_work = snapshot_interval_s(p, interval_s, mtbf) / 2
    elif system == "in_place":  # everyone waits for the replacement to start, then for its catch-up
        recovery = p["recovery_in_place_s"] + p["regroup_at_scale_s"] + p["worker_start_at_scale_s"]
        restore = p["state_gb_per_gpu"] / p["peer_gbps_per_gpu"]
        lost_work = p["step_s"]  # the void step, trained again
    elif system == "train_on":  # a stop for the shrink, another for the join; the width is short meanwhile
        recovery = p["recovery_train_on_s"] + p["regroup_at_scale_s"]
        restore = p["join_pause_s"] + p["regroup_at_scale_s"] + p["state_gb_per_gpu"] / p["peer_gbps_per_gpu"]
        narrower = min(1.0, p["replica_gpus"] / gpus) * p["worker_start_at_scale_s"]
        lost_work = p["step_s"] + narrower  # the void step, and the missing replica's share while it starts
    else:
        raise ValueError(system)
    return {"recovery_s": recovery, "restore_s": restore, "lost_work_s": lost_work,
            "total_s": recovery + restore + lost_work}


def steady_overhead(system: str, p: dict[str, float], interval_s: float, mtbf: float = math.inf) -> float:
    """Fraction of fault-free time lost: checkpoint stall per interval (+ the runtime's loop cost, + snapshots)."""
    if system in ("stock", "stock_daly"):
        return p["sync_stall_s"] / interval_s
    async_stall = p["async_stall_ratio"] * p["sync_stall_s"] / interval_s
    with_snapshots = system in ("snapshots", "in_place", "train_on")
    snapshots = snapshot_cost_s(p) / snapshot_interval_s(p, interval_s, mtbf) if with_snapshots else 0.0
    return p["loop_overhead"] + async_stall + snapshots


def evaluate(system: str, p: dict[str, float], mtbf: float, gpus: float = math.inf) -> dict[str, Any]:
    """Goodput = max(0, (1 - steady overhead) × (1 - λ × E[lost per failure]))."""
    interval = young_daly_interval_s(p, mtbf) if system == "stock_daly" else 60 * p["checkpoint_interval_min"]
    loss = per_failure(system, p, interval, mtbf, gpus)
    overhead = steady_overhead(system, p, interval, mtbf)
    exposure = loss["total_s"] / mtbf  # λ × E[lost per failure]
    goodput = max(0.0, (1 - overhead) * (1 - exposure))
    return {"goodput": goodput, "steady_overhead": overhead, "lost_per_failure": loss,
            "failures_per_hour": 3600 / mtbf, "lambda_x_lost": exposure, "interval_s": interval,
            "first_order_valid": exposure <= FIRST_ORDER_LIMIT}


def model(p: dict[str, float], gpus: tuple[int, ...]) -> dict[str, Any]:
    """Every source at every scale, every system: what --json writes."""
    sources: dict[str, Any] = {}
    for source in SOURCES:
        rows: list[dict[str, Any]] = []
        for n in gpus:
            mtbf = mtbf_s(source, n)
            systems = {name: evaluate(name, p, mtbf, n) for name in SYSTEMS}
            rows.append({"gpus": n, "mtbf_h": mtbf / 3600, "systems": systems,
                         "snapshot_interval_s": snapshot_interval_s(p, 60 * p["checkpoint_interval_min"], mtbf)})
        sources[source.key] = {
            "label": source.label, "citation": source.citation, "failures_per_gpu_hour": source.per_gpu_hour,
            "anchor": {"gpus": source.anchor_gpus, "published_mtbf_h": source.anchor_mtbf_h,
                       "model_mtbf_h": mtbf_s(source, source.anchor_gpus) / 3600},
            "by_gpus": rows,
        }
    return {
        "gpus": list(gpus),
        "params": {k: {"value": p[k], "unit": v.unit, "kind": v.kind, "source": v.source} for k, v in PARAMS.items()},
        "derived": {"checkpoint_interval_s": 60 * p["checkpoint_interval_min"],
                    "bandwidth_write_s": p["state_gb_per_gpu"] / p["storage_gbps_per_gpu"],
                    "restore_disk_at_scale_s": restore_disk_at_scale_s(p),
                    "async_stall_s": p["async_stall_ratio"] * p["sync_stall_s"],
                    "snapshot_s": snapshot_cost_s(p)},
        "systems": SYSTEMS,
        "sources": sources,
        "first_order_limit": FIRST_ORDER_LIMIT,
    }


# --- the text --------------------------------------------------------------------------------------------------


def fmt_hours(h: float) -> str:
    return f"{h:.3g} h" if h >= 1 else f"{h * 60:.3g} min"


def inputs_text(p: dict[str, float], results: dict[str, Any]) -> list[str]:
    d = results["derived"]
    lines = ["Inputs (measured: by this repository's benchmarks, README figures; assumption or target: not measured)"]
    for key, param in PARAMS.items():
        value = f"{p[key]:g} {param.unit}".strip()
        lines.append(f"  {key:24} {value:>9}  {param.kind:10}  {param.source}")
    lines += [
        "Derived",
        f"  checkpoint interval C = {d['checkpoint_interval_s']:g} s",
        f"  writing the state alone: state_gb_per_gpu / storage_gbps_per_gpu = {d['bandwidth_write_s']:.3g} s "
        f"(sync_stall_s = {p['sync_stall_s']:g} s is an assumption on top: serialisation, metadata, the slowest "
        "of N writers)",
        f"  restore from disk at scale = max(restore_disk_s, state_gb_per_gpu / storage_gbps_per_gpu) "
        f"= {d['restore_disk_at_scale_s']:.3g} s (assumption: per-GPU bandwidth holds at every scale)",
        f"  async stall per save = async_stall_ratio x sync_stall_s = {d['async_stall_s']:.3g} s",
        f"  one snapshot = state_gb_per_gpu / pcie_gbps_per_gpu = {d['snapshot_s']:.3g} s, charged whole to the loop",
        f"  loop_overhead = {p['loop_overhead']:.4g}: "
        + (f"from --measured {results['measured_from']}" if results.get("measured_from") else "the README's figure"),
        "Failure rates (job rate = per-GPU rate x N: failures assumed independent per GPU; figures as the issue "
        "quotes them)",
    ]
    for source in SOURCES:
        anchor = results["sources"][source.key]["anchor"]
        check = (f"; reproduces its anchor: {fmt_hours(anchor['model_mtbf_h'])} at {anchor['gpus']:,} GPUs"
                 if anchor["published_mtbf_h"] is not None else "")
        lines.append(f"  {source.key:13} {source.per_gpu_hour:.3g} /GPU-h  {source.citation}{check}")
    one_k = next(s for s in SOURCES if s.key == "meta-rsc-1k")
    lines.append(f"  (meta-rsc-1k scaled to 16,384 GPUs gives {fmt_hours(mtbf_s(one_k, 16_384) / 3600)}, "
                 "not the paper's 1.8 h: linear scaling is pessimistic between these anchors)")
    return lines


def table(header: str, columns: list[str], rows: list[tuple[str, list[str]]], width: int = 42) -> list[str]:
    lines = [f"{header:{width}}" + "".join(f"{c:>11}" for c in columns)]
    lines += [f"{label:{width}}" + "".join(f"{c:>11}" for c in cells) for label, cells in rows]
    return lines


def goodput_cell(cell: dict[str, Any]) -> str:
    return f"{cell['goodput']:.3f}" + ("" if cell["first_order_valid"] else "*")


def report(p: dict[str, float], results: dict[str, Any]) -> str:
    cols = [f"{n:,}" for n in results["gpus"]]
    lines = ["Goodput at scale: torchrun + checkpoint-restart vs torchrevive, analytic model (no training)", ""]
    lines += inputs_text(p, results)
    lines += ["", *table("MTBF of the job, per source", cols, [
        (s.key, [fmt_hours(r["mtbf_h"]) for r in results["sources"][s.key]["by_gpus"]]) for s in SOURCES])]
    interval = 60 * p["checkpoint_interval_min"]
    loss_rows = []
    for name in ("stock", "today", "in_place", "train_on"):
        loss = per_failure(name, p, interval, gpus=GPUS[1])
        loss_rows.append((SYSTEMS[name], [f"{loss[k]:.1f}" for k in ("recovery_s", "restore_s", "lost_work_s",
                                                                      "total_s")]))
    lines += ["", *table("Per failure, seconds", ["recovery", "restore", "lost work", "total"], loss_rows)]
    lines.append(f"  ({SYSTEMS['stock_daly']}: lost work = Young/Daly interval / 2; {SYSTEMS['snapshots']}: "
                 "restore from memory, lost work = snapshot interval / 2; both per scale below; train on: "
                 f"restore = the join, lost work at {GPUS[1]:,} GPUs)")
    minutes = p["checkpoint_interval_min"]
    for source in SOURCES:
        rows_by_gpus = results["sources"][source.key]["by_gpus"]
        cells = {name: [goodput_cell(r["systems"][name]) for r in rows_by_gpus] for name in SYSTEMS}
        daly = [f"{r['systems']['stock_daly']['interval_s'] / 60:.1f}" for r in rows_by_gpus]
        every = [f"{r['snapshot_interval_s'] / 60:.2f}" for r in rows_by_gpus]
        rows = [
            (f"{SYSTEMS['stock']} ({minutes:g} min)", cells["stock"]),
            (SYSTEMS["stock_daly"], cells["stock_daly"]),
            ("  Young/Daly interval, min", daly),
            (f"{SYSTEMS['today']} ({minutes:g} min)", cells["today"]),
            (SYSTEMS["snapshots"], cells["snapshots"]),
            ("  snapshot interval (auto), min", every),
            (SYSTEMS["in_place"], cells["in_place"]),
            (SYSTEMS["train_on"], cells["train_on"]),
        ]
        lines += ["", f"{source.key}: {source.citation}", *table(f"Goodput, {source.key}", cols, rows)]
    lines += ["", f"*: lambda x E[lost per failure] > {FIRST_ORDER_LIMIT}: the first-order model is outside its range "
              "(no failures during recovery or redone work); read as 'collapses'."]
    return "\n".join(lines)


def plot(p: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [round(10 ** (3 + 2 * i / 60)) for i in range(61)]
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"stock": "tab:red", "stock_daly": "tab:orange", "today": "tab:blue", "snapshots": "tab:green",
              "in_place": "tab:purple", "train_on": "tab:brown"}
    for key, style in zip(PLOT_SOURCES, ("-", "--")):
        source = next(s for s in SOURCES if s.key == key)
        for name, label in SYSTEMS.items():
            values = [evaluate(name, p, mtbf_s(source, n), n)["goodput"] for n in gpus]
            anchor = f"{source.anchor_gpus:,}-GPU anchor"
            ax.plot(gpus, values, style, color=colors[name], label=f"{label} ({anchor})")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.02)
    ax.set_title("Goodput vs scale, Meta research-cluster failure rates (Kokolis et al. 2024)\n"
                 "solid: MTTF 1.8 h at 16,384 GPUs, dashed: 7.9 h at 1,024, each scaled linearly", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the command line ------------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        fail(PROG, message)


def check_value(key: str, value: Any) -> float:
    param = PARAMS[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, not {value!r}")
    if value < 0 or (param.positive and value == 0):
        raise ValueError(f"{key} must be {'> 0' if param.positive else '>= 0'}, not {value!r}")
    if param.fraction and value >= 1:
        raise ValueError(f"{key} is a fraction and must be < 1, not {value!r}")
    return float(value)


def number(key: str):
    def parse(text: str) -> float:
        try:
            return check_value(key, float(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e) if "must" in str(e) else f"not a number: {text!r}") from None
    return parse


def gpu_list(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(g) for g in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes positive integers, comma-separated, not {text!r}") from None
    if not gpus or min(gpus) < 1:
        raise argparse.ArgumentTypeError(f"--gpus takes positive integers, comma-separated, not {text!r}")
    return gpus


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    for key, param in PARAMS.items():
        unit = f" ({param.unit})" if param.unit else ""
        parser.add_argument(f"--{key.replace('_', '-')}", type=number(key), default=None,
                            help=f"{param.kind}{unit}, default {param.default:g}: {param.source}".replace("%", "%%"))
    parser.add_argument("--measured", type=Path, help="JSON object of the inputs above, keys with underscores")
    parser.add_argument("--gpus", type=gpu_list, default=GPUS, help="job sizes, comma-separated (1000,10000,100000)")
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--plot", type=Path, help="write goodput vs GPUs (Meta rates) here, PNG; needs matplotlib")
    return parser.parse_args(argv)


def load_measured(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        fail(PROG, f"--measured {path}: cannot read it ({e.strerror if isinstance(e, OSError) else e})")
    except json.JSONDecodeError as e:
        fail(PROG, f"--measured {path}: not JSON ({e})")
    if not isinstance(data, dict):
        fail(PROG, f"--measured {path}: must hold a JSON object")
    if {"benchmark", "provenance", "results"} <= data.keys():  # a benchmark's result file (provenance.py)
        if not isinstance(data["results"], dict):
            fail(PROG, f"--measured {path}: its results must be a JSON object")
        data = {key: value for key, value in data["results"].items() if key in PARAMS}  # the inputs it measured
    unknown = sorted(set(data) - set(PARAMS))
    if unknown:
        fail(PROG, f"--measured {path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(PARAMS)})")
    try:
        return {key: check_value(key, value) for key, value in data.items()}
    except ValueError as e:
        fail(PROG, f"--measured {path}: {e}")


def inputs(args: argparse.Namespace) -> dict[str, float]:
    """Defaults, then the --measured file, then the flags."""
    p = {key: param.default for key, param in PARAMS.items()}
    if args.measured is not None:
        p.update(load_measured(args.measured))
    p.update({key: getattr(args, key) for key in PARAMS if getattr(args, key) is not None})
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = inputs(args)
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail(PROG, "--plot needs matplotlib, which is not installed")
    results = model(p, args.gpus)
    if args.measured is not None:
        results["measured_from"] = str(args.measured)
    print(report(p, results))
    try:
        if args.json is not None:
            write_result(args.json, "goodput_at_scale", results)
            print(f"\nresults: {args.json}")
        if args.plot is not None:
            plot(p, args.plot)
            print(f"plot: {args.plot}")
    except OSError as e:
        fail(PROG, f"cannot write {e.filename}: {e.strerror}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
