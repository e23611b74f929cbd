"""A slow rank, side by side: plain DDP, the runtime naming it (`--slow-ranks report`) and rebalancing
its work (`--slow-ranks rebalance`), against the same job with no rank throttled.

    python benchmarks/slow_rank.py                          # 2 and 4 ranks on CPU, one at half speed
    python benchmarks/slow_rank.py --ranks 2 --stopped 0.8 --stop-when-named --modes none,report,rebalance

Each (world size, mode) is one job of `benchmarks/slow_rank_worker.py` processes (gloo, a small MLP,
`--batch-size` samples per rank per step, 64 by default). The last rank is throttled from outside its
process, once rank 0 has logged `--throttle-after` steps, to `1 - --stopped` of one CPU (0.5: half speed; each rank is given one
thread): `--throttle cgroup` moves it into a cgroup of its own whose CPU quota says so (cgroup v2
`cpu.max`, or v1 `cpu.cfs_quota_us`, under /sys/fs/cgroup: needs root); `--throttle stop` stops it
`--stopped` of every `--period` seconds (SIGSTOP/SIGCONT); `auto` (the default) takes the cgroup where
one can be made, else the duty cycle, and says which. A slowdown the runtime injected itself could be
shaped to suit it; this one is the kernel's. Mode `none` runs `report` with no rank throttled: its
straggler events are false alarms.

Per job: throughput in samples/s over the steps from `--throttle-after` + `--settle` to the end (from
rank 0's step times; under rebalance from its first new split + `--settle` when later), its ratio to
the ideal (the sum of the ranks' speeds: the unthrottled job's throughput x (W - 1 + (1 - stopped)) /
W), the seconds from the throttle to the first `straggler`
event and the rank it names, the straggler events of the unthrottled job, and exactly-once from the
sample audit (elastic.chaos.samples) of every job under the runtime. `--stop-when-named` ends each
job under the runtime with SIGTERM (every rank stops at one step) once the event it waits for is
logged (report: the straggler; rebalance: the first `rebalance` and `--settle` x 2 steps after it;
none: `--steps` steps), so a short form depends on no timing: `--steps` is then the cap.
`--json FILE` writes the rows.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name
from common import read_jsonl, world_sizes  # noqa: E402
from provenance import write_result  # noqa: E402

from elastic.chaos.netns import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "slow_rank_worker.py"
MODES = ("none", "ddp", "report", "rebalance")
BATCH = 64
"""Samples per rank per step (`--batch-size`)."""
THROTTLES = ("auto", "cgroup", "stop")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PERIOD_US = 10_000
"""The quota's period: well below a step, so the rank runs slower rather than in bursts (the kernel's default
period, 100 ms, is several steps: the rank would run at full speed, then stop for the rest of the period)."""


@dataclass
class Row:
    world_size: int
    mode: str
    samples_per_s: float
    steps: int
    named_rank: int | None = None
    seconds_to_named: float | None = None
    false_alarms: int | None = None
    rebalanced: list[int] | None = None
    exactly_once: bool | None = None
    audit: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}, comma-separated")
    p.add_argument("--batch-size", type=int, default=BATCH, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=600, help="steps per job (with --stop-when-named: the cap)")
    p.add_argument("--throttle-after", type=int, default=30, help="steps before the throttle starts")
    p.add_argument("--settle", type=int, default=60, help="steps after the throttle before the throughput counts")
    p.add_argument("--stopped", type=float, default=0.5, help="share of each period the throttled rank is stopped")
    p.add_argument("--period", type=float, default=0.02, help="seconds of one stop/continue cycle (well below a step)")
    p.add_argument("--throttle", choices=THROTTLES, default="auto",
                   help="cgroup: a CPU quota of its own cgroup; stop: a SIGSTOP/SIGCONT duty cycle; auto: cgroup if possible")
    p.add_argument("--stop-when-named", action="store_true", help="end each job once what it waits for is logged")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a job may take")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--workdir", default=None, help="keep each job's files here (default: a temporary directory)")
    opts = p.parse_args(argv)
    opts.world_sizes = world_sizes(p, opts.ranks, "a slow rank needs a peer")
    opts.mode_list = opts.modes.split(",")
    if not opts.mode_list or any(m not in MODES for m in opts.mode_list):
        p.error(f"--modes takes {', '.join(MODES)}, comma-separated, not {opts.modes!r}")
    if not 0 < opts.stopped < 1 or not opts.period > 0:
        p.error("--stopped must be between 0 and 1 and --period above 0")
    if opts.batch_size < 8:
        p.error("--batch-size must be at least 8 (a rank's share moves in single samples)")
    if opts.throttle_after < 1 or opts.settle < 1 or opts.steps <= opts.throttle_after + opts.settle:
        p.error("--steps must exceed --throttle-after + --settle, each at least 1")
    opts.cgroup = cgroup_layout(CGROUP_ROOT) if opts.throttle != "stop" else None
    if opts.throttle == "cgroup" and opts.cgroup is None:
        p.error(f"--throttle cgroup: no writable cgroup CPU controller under {CGROUP_ROOT} (v2 cpu.max or v1 "
                "cpu.cfs_quota_us; root needed); --throttle stop uses a SIGSTOP/SIGCONT duty cycle")
    return opts


class Throttle(Protocol):
    started_at: float | None

    def start(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class CgroupLayout:
    """Where a CPU quota can be set: `version` 2 (`cpu.max` in `parent`'s children) or 1 (`cpu.cfs_quota_us`)."""

    version: int
    parent: Path


def cgroup_layout(root: Path) -> CgroupLayout | None:
    """The cgroup hierarchy under `root` that takes a CPU quota and that this process may write to: v2 when
    its root delegates the cpu controller to children, else v1's cpu hierarchy; None for neither."""
    def has(path: Path, word: str) -> bool:
        try:
            return word in path.read_text().split()
        except OSError:
            return False

    if has(root / "cgroup.controllers", "cpu") and has(root / "cgroup.subtree_control", "cpu") \
            and os.access(root, os.W_OK):
        return CgroupLayout(2, root)
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
            return CgroupLayout(1, v1)
    return None


def quota_files(layout: CgroupLayout, share: float, period_us: int = CGROUP_PERIOD_US) -> dict[str, str]:
    """What to write in a new cgroup of `layout` to hold its processes to `share` of one CPU."""
    if not 0 < share <= 1:
        raise ValueError(f"share={share} must be in (0, 1]")
    quota = max(1000, round(share * period_us))  # the kernel's least quota is 1 ms
    if layout.version == 2:
        return {"cpu.max": f"{quota} {period_us}"}
    return {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota)}


class CgroupQuota:
    """Holds `pid` to `share` of one CPU: a cgroup of its own under `layout.parent` with that CPU quota,
    the process moved into it at `start()` and back to the parent at `stop()` (the cgroup removed)."""

    name = "cgroup CPU quota"

    def __init__(self, pid: int, share: float, layout: CgroupLayout) -> None:
        self.pid, self.share, self.layout = pid, share, layout
        self.path = layout.parent / f"torchrevive-slow-rank-{os.getpid()}-{pid}"
        self.started_at: float | None = None

    def start(self) -> None:
        try:
            self.path.mkdir()
            for name, value in quota_files(self.layout, self.share).items():
                (self.path / name).write_text(value)
            (self.path / "cgroup.procs").write_text(str(self.pid))  # every thread of the process moves
        except OSError as error:  # a controller that looked writable and is not: say so, not a traceback
            raise SystemExit(f"slow_rank.py: cannot throttle by a cgroup CPU quota ({error}); --throttle stop "
                             "uses a SIGSTOP/SIGCONT duty cycle") from None
        self.started_at = time.time()

    def stop(self) -> None:
        if not self.path.exists():
            return
        try:
            (self.layout.parent / "cgroup.procs").write_text(str(self.pid))
        except OSError:
            pass  # it exited: the cgroup is empty already
        try:
            self.path.rmdir()
        except OSError as error:
            print(f"slow_rank.py: could not remove {self.path}: {error}", file=sys.stderr)


def make_throttle(pid: int, opts: argparse.Namespace) -> Throttle:
    """The throttle `--throttle` asks for: a cgroup quota where `parse_args` found one, else the duty cycle."""
    if opts.cgroup is not None:
        return CgroupQuota(pid, 1 - opts.stopped, opts.cgroup)
    return DutyCycle(pid, opts.stopped, opts.period)


class DutyCycle:
    """Stops `pid` for `stopped` of every `period` seconds (SIGSTOP, SIGCONT) until `stop()`."""

    name = "SIGSTOP/SIGCONT duty cycle"

    def __init__(self, pid: int, stopped: float, period: float) -> None:
        self.pid, self.stopped, self.period = pid, stopped, period
        self.started_at: float | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duty-cycle", daemon=True)

    def start(self) -> None:
        self.started_at = time.time()
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.period * self.stopped)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.period * (1 - self.stopped))
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()


def throughput(steps: list[dict], first: int, samples_per_step: int) -> tuple[float, int]:
    """Samples/s from step `first` to the last step logged: (samples/s, steps counted)."""
    times = {s["step"]: s["time"] for s in steps if isinstance(s.get("step"), int)}
    last = max(times, default=0)
    if first not in times or last <= first or times[last] <= times[first]:
        return float("nan"), 0
    return (last - first) * samples_per_step / (times[last] - times[first]), last - first


def run_job(world: int, mode: str, opts: argparse.Namespace, workdir: Path) -> Row:
    job = workdir / f"w{world}-{mode}"
    job.mkdir(parents=True)
    steps_file, events = job / "steps.jsonl", job / "events.jsonl"
    runtime = mode != "ddp"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               ELASTIC_SAMPLE_LOG=str(job / "samples"))
    worker_mode = "report" if mode == "none" else mode
    command = [sys.executable, *(["-m", "elastic.chaos.samples"] if runtime else []), str(WORKER),
               "--mode", worker_mode, "--steps", str(opts.steps), "--batch-size", str(opts.batch_size),
               "--steps-file", str(steps_file), *(["--events", str(events)] if runtime else [])]
    procs = []
    for rank in range(world):
        with open(job / f"out{rank}", "wb") as out:
            procs.append(subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=out, stderr=subprocess.STDOUT, cwd=job))
    throttle = make_throttle(procs[-1].pid, opts) if mode != "none" else None
    deadline = time.monotonic() + opts.timeout
    stopped_early = False
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise SystemExit(f"slow_rank.py: the {mode} job of {world} ranks ran past --timeout {opts.timeout:g} s")
            done = max((s.get("step", 0) for s in read_jsonl(steps_file)), default=0)
            if throttle is not None and throttle.started_at is None and done >= opts.throttle_after:
                throttle.start()
            if runtime and opts.stop_when_named and not stopped_early and waited_for(mode, read_jsonl(events), done, opts):
                for p in procs:
                    p.send_signal(signal.SIGTERM)  # every rank stops at one step (the step vote)
                stopped_early = True
            time.sleep(0.05)
    finally:
        if throttle is not None:
            throttle.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
    codes = [p.wait() for p in procs]
    allowed = {0, 143} if stopped_early else {0}
    if set(codes) - allowed:
        tail = (job / "out0").read_text()[-2000:] + (job / f"out{world - 1}").read_text()[-2000:]
        raise SystemExit(f"slow_rank.py: the {mode} job of {world} ranks exited {codes}:\n{tail}")
    return summarize(world, mode, read_jsonl(steps_file), read_jsonl(events), throttle, opts,
                     audit_of(job / "samples") if runtime else None)


def waited_for(mode: str, events: list[dict], done: int, opts: argparse.Namespace) -> bool:
    if mode == "none":
        return done >= opts.throttle_after + opts.settle * 2
    if mode == "report":  # the throttled rank (the last) named
        return any(e.get("event") == "straggler" and e.get("rank") == e.get("world_size", 0) - 1 for e in events)
    # a split that gives the throttled rank (the last) the smallest share, and the steps to measure it
    found = [e for e in events if e.get("event") == "rebalance" and isinstance(e.get("shares"), list)
             and e["shares"] and e["shares"][-1] == min(e["shares"]) and len(set(e["shares"])) > 1]
    return bool(found) and done >= found[0]["step"] + opts.settle * 2


def audit_of(prefix: Path) -> tuple[bool, str]:
    from elastic.chaos.samples import audit

    result = audit(prefix)
    return not result.problems, f"{result.steps} steps, {result.samples} samples" + (
        f"; {result.problems[0]}" if result.problems else "")


def summarize(world: int, mode: str, steps: list[dict], events: list[dict], throttle: Throttle | None,
              opts: argparse.Namespace, audited: tuple[bool, str] | None) -> Row:
    """One job's row, from rank 0's step times, the event log and the audit. Throughput counts from step
    --throttle-after + --settle; a rebalancing job's from its first new split + --settle when that is later
    (the steady state the split is for: the time to it is the `named` column's)."""
    rebalanced = [e for e in events if e.get("event") == "rebalance"]
    first = opts.throttle_after + opts.settle
    if mode == "rebalance" and rebalanced and isinstance(rebalanced[0].get("step"), int):
        first = max(first, rebalanced[0]["step"] + opts.settle)
    rate, counted = throughput(steps, first, getattr(opts, "batch_size", BATCH) * world)
    row = Row(world, mode, rate, counted)
    stragglers = [e for e in events if e.get("event") == "straggler"]
    if mode == "none":
        row.false_alarms = len(stragglers)
    elif throttle is not None and throttle.started_at is not None:
        # Named: the first event naming the throttled rank (the last) once throttled; any other event of
        # the job (another rank, or before the throttle: contention on a busy machine) is a false alarm.
        hits = [e for e in stragglers if e.get("rank") == world - 1 and e["time"] >= throttle.started_at]
        row.false_alarms = len(stragglers) - len(hits)
        if hits:
            row.named_rank = hits[0].get("rank")
            row.seconds_to_named = hits[0]["time"] - throttle.started_at
    if rebalanced:
        row.rebalanced = rebalanced[-1].get("shares")
    if audited is not None:
        row.exactly_once, row.audit = audited
    return row


def table(rows: list[Row], stopped: float) -> list[str]:
    """The rows as a table: throughput, ratio to the ideal (the unthrottled job's throughput scaled by the
    sum of the ranks' speeds), time to the straggler event, false alarms, the audit."""
    lines = [(f"{'ranks':>5} {'mode':<10} {'samples/s':>10} {'of ideal':>9} {'named':>12} {'false':>6} "
              f"{'shares':>12} {'exactly-once':>13}")]
    for world in sorted({r.world_size for r in rows}):
        base = next((r.samples_per_s for r in rows if r.world_size == world and r.mode == "none"), None)
        ideal = base * (world - 1 + (1 - stopped)) / world if base else None
        for row in (r for r in rows if r.world_size == world):
            ratio = f"{row.samples_per_s / ideal:.2f}" if ideal and row.mode != "none" else "-"
            named = (f"rank {row.named_rank} {row.seconds_to_named:.1f} s" if row.seconds_to_named is not None
                     else ("none" if row.mode in ("report", "rebalance") else "-"))
            false = str(row.false_alarms) if row.false_alarms is not None else "-"
            shares = "/".join(map(str, row.rebalanced)) if row.rebalanced else "-"
            once = {True: "yes", False: "NO", None: "-"}[row.exactly_once]
            lines.append(f"{world:>5} {row.mode:<10} {row.samples_per_s:>10.0f} {ratio:>9} {named:>12} {false:>6} "
                         f"{shares:>12} {once:>13}")
    return lines


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (the ideal assumes a core per rank "
          "and nothing else running)", flush=True)
    print("throttle: " + (f"a cgroup v{opts.cgroup.version} CPU quota under {opts.cgroup.parent}" if opts.cgroup
                          else "a SIGSTOP/SIGCONT duty cycle" + (" (no writable cgroup CPU controller)"
                                                                 if opts.throttle == "auto" else "")), flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="slow-rank-") as tmp:
        for world in opts.world_sizes:
            for mode in opts.mode_list:
                row = run_job(world, mode, opts, Path(opts.workdir or tmp))
                rows.append(row)
                print(f"ranks {world}, {mode}: {row.samples_per_s:.0f} samples/s over {row.steps} steps"
                      + (f"; audit: {row.audit}" if row.audit else ""), flush=True)
    how = (f"held to {1 - opts.stopped:.0%} of one CPU by a cgroup v{opts.cgroup.version} CPU quota"
           if opts.cgroup is not None else f"stopped {opts.stopped:.0%} of every {opts.period:g} s (SIGSTOP/SIGCONT)")
    print(f"\none rank {how} after step {opts.throttle_after}; throughput from step {opts.throttle_after + opts.settle}")
    for line in table(rows, opts.stopped):
        print(line)
    if opts.json:
        write_result(opts.json, "slow_rank", {"stopped": opts.stopped, "rows": [asdict(r) for r in rows]})
    return 0 if all(r.exactly_once is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
