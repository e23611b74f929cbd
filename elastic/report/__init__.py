"""A picture of a run from its event log.

    python -m elastic.report runs/job1.jsonl -o run.png

Panels: loss and throughput against step and against wall time, and the world
size over time. Restarts (new worker groups), restores and checkpoints are
marked, and each recovery is written on the plot with its time (see
`elastic.report.history` for how recoveries are read from the log). The same
recoveries are printed, one line each, and stored in the PNG's text chunks
(`Recoveries`: a JSON list of seconds), so a script can check a picture
against its log.

The text (recoveries, incidents, corruption, slow ranks) needs nothing beyond the package;
matplotlib, an optional dependency (`pip install 'torchrevive[report]'`), draws the picture.
Without it the text is printed all the same, then one line says no picture was drawn (exit 0;
exit 2 when `-o` asked for one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from elastic._shared.common.cli import OneLineArgumentParser, positive_int
from elastic._shared.common.errors import UsageError
from elastic._worker.observe.events import read_events
from elastic.report.history import (
    Recovery,
    Round,
    checkpoints,
    recoveries,
    restores,
    rounds,
)
from elastic.report.incidents import incidents as incident_lines
from elastic.report.incidents import set_aside
from elastic.report.integrity import lines as integrity_lines
from elastic.report.stragglers import episodes as straggler_episodes
from elastic.report.stragglers import lines as straggler_lines

SIZE = (1400, 1000)  # pixels, the default
DPI = 100
THROUGHPUT_WINDOW = 10  # step events per throughput point: smooths the deferred loss read-out's jitter


def load_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The log's events, or a UsageError naming what is wrong with it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no event log at {path}")
    try:
        events = list(read_events(path))
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a JSON-lines event log") from None
    if not any(e.get("event") == "step" for e in events if isinstance(e, dict)):
        raise UsageError(f"{path} holds no step events: nothing to draw (was it written with --events?)")
    return [e for e in events if isinstance(e, dict) and "event" in e and "time" in e]


def throughput(round_: Round) -> tuple[list[float], list[int], list[float], str]:
    """(times, steps, values, unit): tokens/s (or samples/s, or steps/s) over a sliding window."""
    per_step, unit = 1, "steps/s"
    if round_.tokens_per_step:
        per_step, unit = round_.tokens_per_step, "tokens/s"
    elif round_.samples_per_step:
        per_step, unit = round_.samples_per_step, "samples/s"
    times, steps, values = [], [], []
    events = round_.steps
    for i in range(1, len(events)):
        j = max(0, i - THROUGHPUT_WINDOW)
        dt = events[i]["time"] - events[j]["time"]
        if dt > 0:
            times.append(events[i]["time"])
            steps.append(events[i]["step"])
            values.append((events[i]["step"] - events[j]["step"]) * per_step / dt)
    return times, steps, values, unit


def render(
    events: list[dict[str, Any]],
    out: str | os.PathLike[str],
    *,
    title: str = "",
    size: tuple[int, int] = SIZE,
) -> list[Recovery]:
    """Draw the run into a PNG of `size` pixels at `out`; returns the recoveries drawn (`NoPicture` without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise NoPicture("no picture drawn: matplotlib is not installed (pip install 'torchrevive[report]')") from None

    all_rounds = rounds(events)
    found = recoveries(events)
    t0 = min(e["time"] for e in events)

    def rel(t: float) -> float:
        return t - t0

    fig = plt.figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=(1, 1, 0.8))
    loss_step, loss_time = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    tput_step = fig.add_subplot(grid[1, 0], sharex=loss_step)
    tput_time = fig.add_subplot(grid[1, 1], sharex=loss_time)
    world = fig.add_subplot(grid[2, :], sharex=loss_time)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    unit = "steps/s"
    for r in all_rounds:
        if not r.steps:
            continue
        color = colors[r.index % len(colors)]
        label = f"round {r.index} (restart {r.restart}, world {r.world_size})"
        steps = [e["step"] for e in r.steps if "loss" in e]
        losses = [e["loss"] for e in r.steps if "loss" in e]
        times = [rel(e["time"]) for e in r.steps if "loss" in e]
        loss_step.plot(steps, losses, color=color, lw=1, label=label)
        loss_time.plot(times, losses, color=color, lw=1)
        tt, ts, tv, unit = throughput(r)
        tput_step.plot(ts, tv, color=color, lw=1)
        tput_time.plot([rel(t) for t in tt], tv, color=color, lw=1)

    # World size over time: each round's size while it trained, 0 in the gaps.
    xs: list[float] = []
    ys: list[int] = []
    for r in all_rounds:
        if r.steps:
            xs += [rel(r.start_time), rel(r.steps[-1]["time"])]
            ys += [r.world_size, r.world_size]
            xs.append(rel(r.steps[-1]["time"]))
            ys.append(0)
    world.step(xs, ys, where="post", color="black", lw=1.5)
    world.set_ylim(0, max(ys + [1]) + 1)
    world.yaxis.get_major_locator().set_params(integer=True)

    # Markers: restarts (every start after the first), restores, checkpoints.
    for r in all_rounds[1:]:
        for ax in (loss_time, tput_time, world):
            ax.axvline(rel(r.start_time), color="tab:red", ls="--", lw=0.8)
    for e in restores(events):
        for ax in (loss_time, tput_time, world):
            ax.axvline(rel(e["time"]), color="tab:green", ls=":", lw=0.8)
        loss_step.axvline(e["step"], color="tab:green", ls=":", lw=0.8)
    saved = checkpoints(events)
    world.plot([rel(e["time"]) for e in saved], [0.15] * len(saved), "|", color="tab:blue", ms=8)
    # Ticks along the bottom edge (x in data, y in axes units): one per committed step.
    loss_step.plot([e["step"] for e in saved], [0.02] * len(saved), "|", color="tab:blue", ms=8,
                   transform=loss_step.get_xaxis_transform())

    # Each recovery: the gap shaded, and its time written on it.
    for k, rec in enumerate(found):
        for ax in (loss_time, tput_time, world):
            ax.axvspan(rel(rec.stopped_time), rel(rec.resumed_time), color="tab:red", alpha=0.12)
        world.annotate(
            f"{rec.cause}\nrecovered in {rec.seconds:.1f} s",
            xy=(rel(rec.resumed_time), rec.world_size_after),
            xytext=(4, 6 + 22 * (k % 2)), textcoords="offset points", fontsize=8, color="tab:red",
        )

    # Slow ranks: each straggler episode shaded on the throughput against wall time (to the end if unended).
    last = rel(max(e["time"] for e in events))
    for episode in straggler_episodes(events):
        end = rel(episode.end_time) if episode.end_time is not None else last
        tput_time.axvspan(rel(episode.start_time), end, color="tab:orange", alpha=0.15)
        tput_time.annotate(f"rank {episode.rank} slow", xy=(rel(episode.start_time), 1.0),
                           xycoords=("data", "axes fraction"), fontsize=7, color="tab:orange", va="top")

    loss_step.set(title="loss against step (blue ticks: checkpointed steps)", xlabel="step", ylabel="loss")
    loss_time.set(title="loss against wall time", xlabel="seconds since the first event", ylabel="loss")
    tput_step.set(title=f"throughput ({unit}) against step", xlabel="step", ylabel=unit)
    tput_time.set(title=f"throughput ({unit}) against wall time", xlabel="seconds", ylabel=unit)
    world.set(
        title="world size (red dashes: new worker group, green dots: restore, blue ticks: checkpoints committed)",
        xlabel="seconds since the first event", ylabel="workers",
    )
    loss_step.legend(fontsize=7, loc="upper right")
    summary = "; ".join(f"{r.seconds:.1f} s" for r in found) or "none"
    fig.suptitle(f"{title or 'run'}: {len(all_rounds)} worker groups, recoveries: {summary}", fontsize=11)
    for ax in (loss_step, loss_time, tput_step, tput_time, world):
        ax.grid(alpha=0.3)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(
        tmp, format="png", dpi=DPI,
        metadata={"Title": title or "run", "Recoveries": json.dumps([round(r.seconds, 3) for r in found])},
    )
    plt.close(fig)
    os.replace(tmp, out)  # a reader never sees half a picture
    return found


class NoPicture(UsageError):
    """matplotlib is missing: the picture cannot be drawn (the text can)."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="python -m elastic.report", description="Draw a run from its event log.")
    p.add_argument("events", help="the JSON-lines event log (--events of a recipe)")
    p.add_argument("-o", "--output", default=None, help="PNG to write (default: the log's name with .png)")
    p.add_argument("--title", default=None, help="title of the picture (default: the log's file name)")
    p.add_argument("--width", type=positive_int, default=SIZE[0], help="pixels")
    p.add_argument("--height", type=positive_int, default=SIZE[1], help="pixels")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    events = load_events(args.events)
    out = Path(args.output) if args.output else Path(args.events).with_suffix(".png")
    if out.suffix.lower() != ".png":
        raise UsageError(f"{out}: the report is a PNG; name the output *.png")
    found = recoveries(events)
    try:
        render(events, out, title=args.title or Path(args.events).name, size=(args.width, args.height))
    except NoPicture as missing:
        print_text(events, found)
        if args.output:  # a picture was asked for by name
            raise
        print(f"python -m elastic.report: {missing}", file=sys.stderr)
        return 0
    print_text(events, found)
    aside = set_aside(events)
    print(f"wrote {out} ({args.width}x{args.height}, {len(found)} recoveries"
          + (f", nodes set aside: {', '.join(sorted(aside))})" if aside else ")"))
    return 0


def print_text(events: list[dict[str, Any]], found: list[Recovery]) -> None:
    """The report's text: each recovery, then the incidents, corruption and slow ranks (no matplotlib)."""
    for rec in found:
        print(rec.describe())
    for line in incident_lines(events):  # named hangs, failures, nodes set aside, a crash loop (torchrevive-run's)
        print(line)
    for line in integrity_lines(events):  # corruption undone, numeric faults caught (the workers')
        print(line)
    for line in straggler_lines(events):  # slow ranks named, and their recoveries (the workers')
        print(line)

