"""The views of the docs' rendered blocks (benchmarks/render.py): result files in, markdown out.

Each view is registered with `@view("name")` and is named by a block `<!-- figures: name -->` in
README.md or docs/*.md. A view formats what its benchmark measured and ends with the provenance
line of every result file it read (`measured`), so a reader sees how to measure it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common import median
from render import Results, view  # noqa: F401 - `view` registers the views below


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; None cells read "-"."""
    def cell(value: Any) -> str:
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def seconds(value: float | None, digits: int = 2) -> str | None:
    return None if value is None else f"{value:.{digits}f} s"


def ratio(value: float | None, digits: int = 3) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def percent(value: float | None, digits: int = 2) -> str | None:
    return None if value is None else f"{100 * value:.{digits}f} %"


def measured(*documents: dict[str, Any]) -> str:
    """One line per result file: the command, commit, torch, machine and date it was measured with."""
    lines = []
    for document in documents:
        made = document["provenance"]
        machine = made.get("machine") or {}
        commit = (made.get("commit") or "unknown")[:10] + (" (uncommitted changes)" if made.get("dirty") else "")
        load = f", load average {machine['load_15min']}" if machine.get("load_15min") is not None else ""
        lines.append(
            f"*Measured by `{made.get('command', '?')}` at commit {commit}, torch {made.get('torch')}, "
            f"{machine.get('cores')} cores ({machine.get('cpu')}{load}), {made.get('date', '?')[:10]}.*"
        )
    return "\n".join(lines) + "\n"


SETTING_NAMES = {"stock": "plain torchrun, its defaults", "tuned": "plain torchrun, tuned", "ours": "restart (a new round)",
                 "ours-keep": "`keep`", "ours-train-on": "`train-on`", "ours-disk": "restart, no snapshots",
                 "ours-torch-rounds": "restart, torch's rounds", "ours-every-step": "restart, snapshots every step"}
"""benchmarks/recovery.py's settings, as the docs name them."""


def _median(values: Sequence[float | None]) -> float | None:
    """The median of the values there are (None: not measured), None when there are none."""
    return median(v for v in values if v is not None)


@view("recovery")
def recovery(results: Results) -> str:
    """A SIGKILLed worker per setting and model size: time lost, stall, the time line, steps redone, restore source."""
    document = results["recovery"]
    rows = []
    for size, by_setting in document["results"]["sizes"].items():
        for setting, r in by_setting.items():
            line = r.get("median_phases_s") or {}
            sources = ", ".join(sorted(set(r.get("restore_sources") or []))) or None
            rows.append([size, SETTING_NAMES.get(setting, setting),
                         f"{seconds(r.get('lost_median_s'))} ({seconds(r.get('lost_worst_s'))})", seconds(r.get("stall_median_s")),
                         seconds(r.get("median_s")), seconds(line.get("detected")),
                         f"{seconds(line.get('restore_began'))} / {seconds(line.get('restored'))}",
                         f"{seconds(line.get('first_step_s'))} ({seconds(line.get('steady_step_s'))})",
                         max(r.get("redone") or [0]), sources, seconds(_median(r.get("join_pause_s") or []))])
    header = ["size", "setting", "time lost, median (worst)", "stall", "kill to next step", "detected",
              "restore began / ended", "first step (steady)", "steps redone, most", "restored from", "join pause"]
    kills = document["results"]["kills"]
    agents = document["results"]["agents"]
    return (table(header, rows) + f"\n{kills} kills per setting, {agents} agents; times are medians after the kill.\n\n"
            + measured(document))


@view("checkpoint")
def checkpoint(results: Results) -> str:
    """The loop's block per async save against a synchronous torch.save of the same state, one process."""
    document = results["checkpoint"]
    rows = [[name, f"{c['parameters'] / 1e6:.2f} M", f"{c['state_mb']:.1f}", seconds(c["sync_seconds"], 4),
             seconds(c["steady_blocking"], 5), ratio(c["ratio"], 4), seconds(c["commit_seconds"], 3)]
            for name, c in document["results"]["configs"].items()]
    header = ["model", "parameters", "state MB", "sync torch.save", "async: loop blocked per save", "ratio", "async commit"]
    return table(header, rows) + "\n" + measured(document)


@view("goodput_at_scale")
def goodput_at_scale(results: Results) -> str:
    """The analytic model's goodput at 10,000 GPUs, every system under every published failure rate."""
    document = results["goodput_at_scale"]
    found = document["results"]
    at = 10_000
    shown = ("llama3", "meta-rsc-16k")  # the two published rates measured at 16,384 GPUs; the script prints all
    sources = {name: source for name, source in found["sources"].items() if name in shown}
    rows = []
    for system, name in found["systems"].items():
        cells = []
        for source in sources.values():
            point = next((p for p in source["by_gpus"] if p["gpus"] == at), None)
            cells.append(ratio(point["systems"][system]["goodput"]) if point else None)
        rows.append([name, *cells])
    header = ["goodput at 10,000 GPUs", *(source["label"] for source in sources.values())]
    return table(header, rows) + "\n" + measured(document)


@view("readme")
def readme(results: Results) -> str:
    """The README's table: one line per headline figure, each from its result file."""
    rows = []
    soaked = results["soak"]["results"]  # kills at random moments, in the default settings: median and p99
    for setting in ("restart", "keep", "train-on"):
        row = soaked["rows"].get(setting)
        if row is not None:
            lost, kills = row["summary"]["time_lost_s"], row["summary"]["kills"]
            name = "restart (a new round)" if setting == "restart" else f"`{setting}`"
            rows.append([f"time lost per killed worker, median / p99 of {kills} kills at random moments: {name}, GPT "
                         f"recipe at its {soaked['size']} size", f"{seconds(lost['median'])} / {seconds(lost['p99'])}",
                         "[kills at random moments](docs/results.md#kills-at-random-moments)"])
    stall = results["checkpoint"]["results"]["configs"]
    for name, c in stall.items():
        rows.append([f"loop blocked per async checkpoint / a synchronous `torch.save` ({name} model)", ratio(c["ratio"], 4),
                     "[checkpoints](docs/results.md#checkpoint-stall)"])
    at_scale = results["goodput_at_scale"]["results"]
    point = next(p for p in at_scale["sources"]["meta-rsc-16k"]["by_gpus"] if p["gpus"] == 10_000)
    rows.append(["goodput at 10,000 GPUs (a model), `train-on` / plain torchrun",
                 f"{ratio(point['systems']['train_on']['goodput'])} / {ratio(point['systems']['stock']['goodput'])}",
                 "[at scale](docs/results.md#at-scale)"])
    loop = results["overhead"]
    rows.append(["steps/s, the recipe in default settings / a plain DDP loop (95 % interval)",
                 _interval(loop["results"]["ratio"]), "[overhead](docs/results.md#runtime-overhead)"])
    documents = [results["soak"], results["checkpoint"], results["goodput_at_scale"], loop]
    return table(["what", "measured", "in full"], rows) + "\n" + measured(*documents)


def _interval(values: Sequence[float]) -> str:
    """A ratio with its 95 % interval: (ratio, low, high) -> `r [low-high]`."""
    middle, low, high = values
    return f"{middle:.3f} [{low:.3f}-{high:.3f}]"


@view("overhead")
def overhead(results: Results) -> str:
    """The recipe in default settings against a plain seed-style DDP loop, paired blocks; a snapshot's cost."""
    document = results["overhead"]
    found = document["results"]
    rows = [["steps/s, recipe in default settings / plain DDP loop (95 % interval)", _interval(found["ratio"])]]
    snapshots = found.get("snapshots") or {}
    recipe = snapshots.get("recipe_no_metrics") or snapshots.get("recipe")
    if recipe:
        rows.append([f"a snapshot's cost per step, the runtime's own account (every {recipe['every']} steps)",
                     percent(recipe.get("share_per_step"))])
    return table(["what", "measured"], rows) + "\n" + measured(document)


@view("seal_cost")
def seal_cost(results: Results) -> str:
    """A rendezvous round and a process group's start on sealed stores against unsealed, medians."""
    document = results["seal_cost"]
    rows = [[r["what"], f"{r['unsealed_ms']:.1f} ms", f"{r['sealed_ms']:.1f} ms", ratio(r["ratio"])]
            for r in document["results"]["rows"]]
    return table(["what", "unsealed", "sealed", "sealed / unsealed"], rows) + "\n" + measured(document)


@view("warm_cold")
def warm_cold(results: Results) -> str:
    """Steps of workers started warm (forked) against cold (a fresh interpreter), side by side."""
    document = results["warm_cold"]
    found = document["results"]
    row = [f"{found['nproc_per_node']} workers on a node, cold / warm step time (95 % interval)",
           _interval([found["ratio_cold_over_warm"], *found["ci95"]])]
    return table(["what", "measured"], [row]) + "\n" + measured(document)


@view("scale")
def scale(results: Results) -> str:
    """The control plane by simulation: store operations per rank for each path at each N, and their growth."""
    document = results["scale"]
    found = document["results"]
    sizes = [str(n) for n in found["sizes"]]
    rows = [[path, *(ratio(by_n.get(n, {}).get("ops_per_rank"), 1) for n in sizes), found["growth"].get(path)]
            for path, by_n in found["paths"].items()]
    header = ["store operations per rank", *(f"N={n}" for n in sizes), "growth"]
    return table(header, rows) + "\n" + measured(document)


@view("soak")
def soak(results: Results) -> str:
    """Kills at random moments, per survivors setting: stall and time lost (median / p99 / max), steps redone,
    exactly-once and bit-identity, incidents over the bound; then what a kill cost by the moment drawn."""
    document = results["soak"]
    found = document["results"]
    rows, by_kind = [], {}
    for label, row in found["rows"].items():
        s = row["summary"]
        spread = [" / ".join(ratio(s[figure][k], 2) or "-" for k in ("median", "p99", "max"))
                  for figure in ("stall_s", "time_lost_s")]
        never = sum(1 for incident in row["incidents"] if incident["time_lost_s"] is None)
        over = f"{len(s['over_bound'])} ({never} never steady again)" if never else len(s["over_bound"])
        rows.append([label, s["kills"], *spread, ratio(s["redone"]["mean"], 1), s["exactly_once"], s["bit_identical"],
                     over])  # (a job never steady again has no time lost: the figures leave it out, this says so)
        for incident in row["incidents"]:
            if incident["time_lost_s"] is not None:
                by_kind.setdefault(incident["kind"], []).append(incident["time_lost_s"])
    header = ["setting", "kills", "stall s (median / p99 / max)", "time lost s (same)", "redone", "exactly once",
              "bit-identical", "over bound"]
    moments = ", ".join(f"{kind} {len(lost)} ({ratio(_median(lost), 2)} s)"
                        for kind, lost in sorted(by_kind.items(), key=lambda kv: -len(kv[1])))
    return (table(header, rows) + f"\n{found['agents']} agents, {found['size']} size. Time lost by moment drawn "
            f"(incidents, median): {moments}.\n\n" + measured(document))
