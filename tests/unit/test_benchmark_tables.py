"""The benchmark scripts' tables, ratios and verdicts, from recorded measurements, and their refusals.

Every script in benchmarks/ turns what its jobs measured into the lines it prints: here those functions
(`report`, `row`, `verdict`, `row_figures`, ...) get measurements written by hand, in the shapes and
sizes the scripts see on a 2-core machine, and the refusals of bad flags are checked in this process
(argparse refuses before anything starts). What only a real run can show (exact bytes read, states
restored bit for bit, processes counted, the jobs' exit) is checked by the one end-to-end run of each
script, with its smallest arguments, in tests/integration/test_benchmarks.py and
test_benchmarks_snapshots.py.

benchmarks/ is no package: a script is loaded by path, once per process (`script`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import statistics
import sys
import threading
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from support import REPO

from elastic._worker.observe.step_costs import PHASES

BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
"""The scripts that run from a main guard (hf_resume_stock.py and hf_resume_elastic.py are Trainer scripts
that train when run at all, and hf_resume_common.py is their shared part)."""


def load(name: str, module_name: str) -> tuple[ModuleType, list[str]]:
    """benchmarks/`name`.py run as module `module_name`, and the entries it added to sys.path while it
    imported (taken out again: they serve its imports, and no other test should import through them)."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    sys.modules[module_name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    finally:
        added = [p for p in sys.path if p not in path]
        sys.path[:] = path
    return module, added


def script(name: str) -> ModuleType:
    """benchmarks/`name`.py as a module, loaded once per process under its own name (as a sibling
    script imports it, e.g. peer_fetch's `from snapshot_auth import ...`)."""
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "")).resolve() == (BENCHMARKS / f"{name}.py").resolve():
        return module
    return load(name, name)[0]


def refused(capsys: pytest.CaptureFixture[str], call: Any) -> str:
    """`call()` refuses its arguments: exit status 2 (SystemExit, or 2 returned as `main` does in some
    scripts), nothing on stdout, no traceback; returns stderr."""
    try:
        status = call()
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, (out, err)
    return err


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    return err


# -- importing a script is only imports -------------------------------------------------------------


@pytest.mark.parametrize("name", SCRIPTS)
def test_importing_a_benchmark_script_prints_starts_and_changes_nothing(name, capsys, tmp_path, monkeypatch):
    """No output, no thread, no environment variable, no file; sys.path only gains the repository, its
    recipes/ or benchmarks/ (what the script imports from). Processes and servers: the unit tier refuses
    them (tests/unit/conftest.py), so a script that started one here would fail this test."""
    monkeypatch.chdir(tmp_path)
    environ, threads = dict(os.environ), set(threading.enumerate())
    module_name = f"_import_check_{name}"
    try:
        _, added = load(name, module_name)
    finally:
        sys.modules.pop(module_name, None)
    assert capsys.readouterr() == ("", "")
    assert dict(os.environ) == environ
    assert set(threading.enumerate()) == threads
    assert list(tmp_path.iterdir()) == []
    assert set(added) <= {str(REPO), str(REPO / "recipes"), str(BENCHMARKS)}, added


# -- overhead.py --------------------------------------------------------------------------------------

OVERHEAD_ARGS = ["--blocks", "3", "--warmup", "2", "--batch-size", "4", "--ckpt-every", "3",
                 "--scrape-interval", "0.05"]


def overhead_results() -> dict[str, Any]:
    """What the workers of `overhead.py --blocks 3 --ckpt-every 3` hand back (rank 0): 3 blocks of 3
    step seconds per loop, each loop's saves and turns, snapshots, the runtime's per-step costs."""
    timed = {
        "recipe": [[0.0318, 0.0305, 0.0311], [0.0322, 0.0301, 0.0309], [0.0315, 0.0312, 0.0304]],
        "recipe_no_metrics": [[0.0309, 0.0302, 0.0306], [0.0317, 0.0299, 0.0303], [0.0310, 0.0308, 0.0301]],
        "recipe_no_snapshots": [[0.0301, 0.0297, 0.0300], [0.0309, 0.0294, 0.0298], [0.0303, 0.0300, 0.0296]],
        "baseline": [[0.0299, 0.0296, 0.0298], [0.0306, 0.0293, 0.0297], [0.0301, 0.0299, 0.0295]],
    }
    turns, commits, t = [], {"recipe": [], "recipe_no_metrics": [], "recipe_no_snapshots": []}, 100.0
    for _ in range(3):  # rounds of one turn per loop; a save's turn (the first of each interval) is longer
        for name in timed:
            length = 0.12 if name != "baseline" else 0.03
            turns.append([name, t, t + length])
            if name != "baseline":
                commits[name].append([t + 0.01, t + 0.09])  # started and committed within its own turn
            t += length + 0.001
    costs = {name: dict.fromkeys(PHASES, 0.0) for name in ("recipe", "recipe_no_metrics", "recipe_no_snapshots")}
    for name, cost in costs.items():
        cost.update(sampler=0.00004, report=0.00006, vote=0.00002, checkpoint=0.0004, watchdog=0.00001)
        if name != "recipe_no_snapshots":
            cost.update(snapshot_copy=0.0003, snapshot_wait=0.0001)
        if name == "recipe":
            cost.update(metrics=0.00005)
    return {
        "timed": timed, "turns": turns, "commits": commits,
        "snapshots": {name: [{"snapshots": 12, "measured": 10, "every": 3, "allocations": 4, "slot_bytes": 5_055_104,
                              "disabled": None, "capture_seconds": 0.0003, "waited_seconds": 0.00002,
                              "cpu_seconds": 0.0012, "seconds": 0.00152, "replica_seconds": 0.0, "exposed_seconds": 0.0021,
                              "write_seconds": 0.0018}]
                      for name in ("recipe", "recipe_no_metrics")},
        "drained": {name: [0.0011, 0.0009, 0.0012] if name in ("recipe", "recipe_no_metrics") else []
                    for name in timed},
        "costs": costs,
        "intervals": {"recipe": [3], "recipe_no_metrics": [3]},
    }


def test_overhead_prints_the_loops_their_ratios_with_intervals_the_verdicts_and_the_runtimes_costs(
    capsys, tmp_path, monkeypatch
):
    overhead = script("overhead")
    monkeypatch.setattr(script("provenance"), "_git", lambda *args: None)  # a unit test starts no git
    measured = tmp_path / "overhead.json"
    opts = overhead.parse_args([*OVERHEAD_ARGS, "--json", str(measured)])
    overhead.report(opts, overhead_results(), scrapes=41, refused=0,
                    scraped_by_loop={"recipe": 22, "recipe_no_snapshots": 19}, seconds=24.0)
    out = capsys.readouterr().out
    assert "per-step cost of the runtime on the loop" in out, out
    for phase in (*PHASES, "total", "end-to-end"):
        row = re.search(rf"^  {phase} +(( +[\d.-]+ ms +[\d.-]+%)+)", out, re.M)
        assert row and len(re.findall(r"ms", row.group(1))) == 3, (phase, out)  # the three recipe loops
    # Snapshots at their default: every step until measured, then capped at --ckpt-every.
    assert re.search(r"snapshots auto \(every 3 steps at the end\)", out), out
    document = json.loads(measured.read_text())
    assert document["benchmark"] == "overhead" and {"command", "commit", "torch", "machine", "date"} <= document["provenance"].keys()
    figures = document["results"]
    assert 0 <= figures["loop_overhead"] < 1 and figures["snapshot_every"] == "auto"
    assert f"written to {measured} for goodput_at_scale.py --measured" in out
    # A snapshot's cost two ways, as shares of a step without snapshots (the recipe_no_snapshots loop's median).
    step = 1 / overhead.geometric_mean([1 / statistics.median(b) for b in overhead_results()["timed"]["recipe_no_snapshots"]])
    own = re.search(r"^snapshots auto \(every 3 steps at the end\), recipe_no_metrics: 12 taken on rank 0; "
                    r"per snapshot \(median of 10\): "
                    r"capture 0\.30 ms \+ waits 0\.02 ms \+ write CPU 1\.20 ms = 1\.52 ms, ([\d.]+)% of a (\d+) ms step; "
                    r"every 3 step\(s\): ([\d.]+)% per step \(auto's budget: 1 %\); write 1\.80 ms wall; 4 buffers made in all$",
                    out, re.M)
    assert own and float(own.group(1)) == pytest.approx(100 * 0.00152 / step, abs=0.006), out
    assert int(own.group(2)) == round(step * 1e3) and float(own.group(3)) == pytest.approx(float(own.group(1)) / 3, abs=0.006)
    assert re.search(r"^recipe: a kill between a step's end and its snapshot's commit redoes that step: median 2\.10 ms, "
                     r"[\d.]+% of a step", out, re.M), out
    end_to_end = re.search(r"^snapshot cost per step, end to end \(snapshots on / off, .*\): (-?[\d.]+) ms "
                           r"\[95% CI (-?[\d.]+)-(-?[\d.]+)\], (-?[\d.]+)% of a step$", out, re.M)
    assert end_to_end, out
    added, low, high, share = map(float, end_to_end.groups())
    assert low <= added <= high and figures["snapshots"]["end_to_end"]["added_s"] * 1e3 == pytest.approx(added, abs=0.006)
    assert figures["snapshots"]["recipe"]["share_per_step"] == pytest.approx(0.00152 / 3 / step)
    ci = r"\[95% CI ([\d.]+)-([\d.]+)\]"
    ratios = re.findall(rf"recipe/gpt.py [\d.]+ steps/s \| seed-style DDP [\d.]+ steps/s \| ratio ([\d.]+) {ci}", out)
    assert len(ratios) == 2, out  # by 1/median step and by steps/seconds
    on_off = re.search(rf"^metrics on / off: ([\d.]+) {ci} \(1/median step\)", out, re.M)
    assert on_off, out
    for ratio, low, high in [*ratios, on_off.groups()]:
        assert float(low) <= float(ratio) <= float(high), out
    assert re.search(r"^target ratio >= 0.99, 95% interval above 0.98, default settings: (met|MISSED|not resolved)",
                     out, re.M), out
    assert re.search(r"an interval of \+-1 % needs --blocks \d+ \(about \d+ min\)$", out, re.M), out
    saves = re.search(r"^checkpoint every 3 steps: (\d+) saves, 0 not started and committed within one turn", out, re.M)
    assert saves and int(saves.group(1)) == 9, out
    assert re.search(r"^metrics scraped 41 times \(0 refused\), .*\(recipe 22, recipe_no_snapshots 19\)$", out, re.M), out


def test_overhead_verdict_needs_the_ratio_and_its_whole_interval():
    overhead = script("overhead")
    assert overhead.verdict((0.995, 0.985, 1.005)) == "met"
    assert overhead.verdict((0.99, 0.98, 1.0)) == "met"  # both bounds inclusive
    assert overhead.verdict((0.985, 0.981, 0.989)).startswith("MISSED (the ratio is below 0.99)")
    assert overhead.verdict((0.995, 0.975, 1.015)).startswith("not resolved (the interval reaches below 0.98")


def test_overhead_paired_ratio_is_the_geometric_mean_with_a_t_interval_around_it():
    overhead = script("overhead")
    assert overhead.paired_ratio([2.0, 4.0], [1.0, 2.0]) == pytest.approx((2.0, 2.0, 2.0))  # no spread
    assert overhead.t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)  # the t-table's value
    assert overhead.t_quantile(0.975, 29) == pytest.approx(2.045, abs=1e-3)
    a, b = [1.02, 0.98, 1.01, 0.97], [1.0, 1.0, 1.0, 1.0]
    ratio, low, high = overhead.paired_ratio(a, b)
    logs = [math.log(x) for x in a]
    assert ratio == pytest.approx(math.exp(sum(logs) / 4))
    assert low < ratio < high and math.log(high / ratio) == pytest.approx(math.log(ratio / low))
    assert overhead.blocks_to_resolve(a, b) > overhead.blocks_to_resolve([1.001, 0.999], [1.0, 1.0]) >= 2


def test_overhead_counts_a_save_that_ran_past_its_own_loops_turn():
    overhead = script("overhead")
    turns = [("recipe", 0.0, 1.0), ("baseline", 1.0, 2.0), ("recipe", 2.0, 3.0)]
    assert overhead.spilled_saves([(0.1, 0.9), (2.1, 2.9)], turns, "recipe") == 0
    assert overhead.spilled_saves([(0.1, 1.5), (2.1, 2.9)], turns, "recipe") == 1  # committed in the baseline's turn


# -- goodput_at_scale.py: analytic, so its whole run is in-process here ----------------------------------


def test_goodput_prints_its_tables_and_sources(capsys):
    assert script("goodput_at_scale").main([]) == 0
    out = capsys.readouterr().out
    for text in ("recovery_stock_s", "measured", "assumption", "Llama 3 Herd", "Kokolis", "Ant Group",
                 "MTBF", "Young/Daly", "torchrevive + in-memory snapshots", "10,000"):
        assert text in out


def test_goodput_takes_the_loop_overhead_overhead_py_writes(capsys, tmp_path):
    measured = tmp_path / "overhead.json"
    measured.write_text(json.dumps({"loop_overhead": 0.0042}) + "\n")  # overhead.py --json's form
    assert script("goodput_at_scale").main(["--measured", str(measured)]) == 0
    assert f"from --measured {measured}" in capsys.readouterr().out


def test_goodput_help_prints_a_percent_sign_of_a_sources_text(capsys):
    with pytest.raises(SystemExit) as exit_info:
        script("goodput_at_scale").main(["--help"])
    assert exit_info.value.code == 0
    assert "95 % CI" in capsys.readouterr().out


def test_goodput_refuses_a_negative_figure_in_one_line(capsys):
    err = refused(capsys, lambda: script("goodput_at_scale").main(["--restart-at-scale-s", "-3"]))
    assert len(err.strip().splitlines()) == 1, err


# -- control_cost.py ------------------------------------------------------------------------------------

CONTROL_ROW = r"^ +(\d+) +[\d.]+ ms +-?\d+ us +-?[\d.]+% +-?\d+ us +-?[\d.]+%$"


def control_means(step: float) -> dict[str, list[float]]:
    """Per-block mean steps by mode, as a world size's job writes them (2 blocks)."""
    return {"none": [step, step * 1.04], "blocking": [step + 0.0012, step * 1.04 + 0.0010],
            "pipelined": [step + 0.0001, step * 1.04 - 0.00005]}


def test_control_cost_row_is_the_step_and_what_each_vote_adds():
    row = script("control_cost").row(2, control_means(0.00183))
    assert re.fullmatch(CONTROL_ROW, row), row
    base = (0.00183 + 0.00183 * 1.04) / 2  # the median of the blocks without a vote
    cells = re.fullmatch(r" +2 +([\d.]+) ms +(-?\d+) us +(-?[\d.]+)% +(-?\d+) us +(-?[\d.]+)%", row)
    assert cells and float(cells.group(1)) == round(base * 1e3, 3)
    # blocking: the median of the paired differences 1200 and 1000 us; pipelined: of 100 and -50 us
    assert [int(cells.group(2)), float(cells.group(3))] == [1100, round(0.0011 / base * 100, 2)]
    assert [int(cells.group(4)), float(cells.group(5))] == [25, round(0.000025 / base * 100, 2)]


def test_control_cost_prints_a_row_per_world_size_in_order(capsys, monkeypatch):
    control_cost = script("control_cost")
    measured = []

    def measure(opts, world_size):
        measured.append((world_size, opts.blocks, opts.block_steps, opts.width))
        return control_means(0.0018 * world_size)

    monkeypatch.setattr(control_cost, "measure", measure)
    assert control_cost.main(["--ranks", "2,3", "--blocks", "2", "--block-steps", "2", "--width", "16"]) == 0
    assert measured == [(2, 2, 2, 16), (3, 2, 2, 16)]
    assert re.findall(CONTROL_ROW, capsys.readouterr().out, re.M) == ["2", "3"]


@pytest.mark.parametrize(("argv", "why"), [
    (["--ranks", "1"], "--ranks: every world size must be at least 2"),
    (["--ranks", "2,x"], "--ranks takes world sizes, comma-separated, not '2,x'"),
    (["--blocks", "1"], "--blocks must be at least 2"),
])
def test_control_cost_refuses_what_it_cannot_measure(capsys, argv, why):
    err = refused(capsys, lambda: script("control_cost").parse_args(argv))
    assert re.search(rf"^\S+: error: {re.escape(why)}", err, re.M), err


# -- checkpoint.py --------------------------------------------------------------------------------------

DIST_ROW = re.compile(
    r"^(today|new) +(ddp|fsdp) +(\d+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) "
    r"+([\d.]+)x +([\d.]+) +([\d.]+) +(ok|MISMATCH)$", re.M)
READ_LINE = re.compile(
    r"^(today|new) (ddp|fsdp) (\d+): restore read (\d+) bytes over \d+ ranks, checkpoint (\d+) bytes", re.M)


def checkpoint_result(name: str, steady: float, sync: float):
    return script("checkpoint").Result(
        name=name, parameters=840_000, state_mb=10.3, sync_seconds=sync, first_blocking=0.0211,
        steady_blocking=steady, steady_call=steady * 0.8, steady_hook_wait=steady * 0.2,
        steady_loop_blocking=steady * 1.1, commit_seconds=0.183, step_free=0.031, step_in_flight=0.036)


def test_checkpoint_stall_ratio_line_says_met_or_missed(capsys):
    checkpoint = script("checkpoint")
    checkpoint.report([checkpoint_result("recipe", 0.0012, 0.0480), checkpoint_result("100m", 0.31, 1.24)])
    out = capsys.readouterr().out
    match = re.search(r"^recipe: checkpoint stall ratio (\S+) \(target <= 0\.05: (met|MISSED)\)$", out, re.M)
    assert match and float(match.group(1)) == pytest.approx(0.0012 / 0.0480, abs=1e-4) and match.group(2) == "met"
    assert re.search(r"^100m: checkpoint stall ratio 0\.2500 \(target <= 0\.05: MISSED\)$", out, re.M), out
    assert re.search(r"^ *recipe +0\.84M +10\.3 +0\.0480 +0\.02110 +0\.00120 +0\.0250 +0\.183 +yes$", out, re.M), out
    assert re.search(r"^ *100m +.* 0\.2500 +0\.183 +NO$", out, re.M), out


def worker_outputs(path: str, mode: str, ranks: int, tree: str, *, restored_step: int = 9) -> tuple[list, list]:
    """What checkpoint_worker.py's ranks write for one row (`--out`, by rank): today's path reads the
    whole checkpoint on every rank, the new one each chunk once over the job."""
    inside = f"step_{restored_step:08d}{os.sep}"
    if path == "today":
        checkpoint_bytes = 3_445_804 + 6_891_608  # model.pt + optimizer.pt
        reads = [{f"{inside}model.pt": 3_445_804, f"{inside}optimizer.pt": 6_891_608, "latest": 21}
                 for _ in range(ranks)]
    else:
        checkpoint_bytes = 10_402_816
        share = checkpoint_bytes // ranks
        reads = [{f"{inside}chunks_{r}.bin": share + (checkpoint_bytes - share * ranks if r == 0 else 0),
                  "writer.json": 180} for r in range(ranks)]
    fingerprint = {"model/w": [1.25, 7.5], "optim/w/exp_avg": [0.01, 0.002]}
    save = [{
        "rank": r, "tree": tree, "parameters": 840_000, "sync_seconds": [0.061],
        "calls": {"5": 0.0210 + r * 0.001, "7": 0.0019 + r * 0.0004},
        "hook_wait": {"5": 0.004, "7": 0.0002} if r == 0 else {"7": 0.0001},
        "history": [{"step": 5, "blocking_seconds": 0.019, "seconds": 0.41},
                    {"step": 7, "blocking_seconds": 0.0015, "seconds": 0.33}] if r == 0 else [],
        "final_step": 9, "fingerprint": fingerprint, "peak_rss": 402_000_000 + r * 1_000_000,
    } for r in range(ranks)]
    restore = [{
        "rank": r, "tree": tree, "step": restored_step, "seconds": 0.21 + r * 0.01, "bytes_read": reads[r],
        "checkpoint_bytes": checkpoint_bytes, "restored_bytes": None if path == "today" else 10_200_000 // ranks,
        "rss_before": 390_000_000, "peak_rss": 405_000_000, "fingerprint": fingerprint,
    } for r in range(ranks)]
    return save, restore


def test_checkpoint_row_takes_the_slowest_rank_and_sums_what_the_ranks_read():
    checkpoint = script("checkpoint")
    save, restore = worker_outputs("today", "ddp", 2, "/tmp/today-tree")
    row = checkpoint.row_figures(checkpoint.DistRow("today", "ddp", 2), Path("/tmp/today-tree"), save, restore)
    assert row.stall_first == pytest.approx(max(0.0210 + 0.004, 0.0220))  # the slowest rank's first save
    assert row.stall == pytest.approx(max(0.0019 + 0.0002, 0.0023 + 0.0001))  # steady: the saves after the first
    assert row.ratio == pytest.approx(row.stall / 0.061)
    assert (row.manager_blocking, row.commit_seconds) == (0.0015, 0.33)
    assert row.restore_seconds == pytest.approx(0.22)  # the slowest rank's
    assert row.bytes_read == 2 * row.checkpoint_bytes and row.other_read == {"latest": 42}  # every rank reads it all
    assert (row.save_rss, row.restore_rss, row.restore_rss_growth) == (805_000_000, 810_000_000, 30_000_000)
    assert row.restored_bytes is None and row.restored_ok and row.check == "ok"

    save, restore = worker_outputs("new", "fsdp", 2, "/tmp/new-tree")
    row = checkpoint.row_figures(checkpoint.DistRow("new", "fsdp", 2), Path("/tmp/new-tree"), save, restore)
    assert row.bytes_read == row.checkpoint_bytes and row.restored_bytes == 10_200_000  # each chunk once
    assert row.other_read == {"writer.json": 360}

    save, restore = worker_outputs("new", "ddp", 1, "/tmp/new-tree")
    restore[0]["fingerprint"] = {"model/w": [1.25, 7.5000001], "optim/w/exp_avg": [0.01, 0.002]}
    row = checkpoint.row_figures(checkpoint.DistRow("new", "ddp", 1), Path("/tmp/new-tree"), save, restore)
    assert not row.restored_ok and row.check.startswith("model/w: saved sum/sumsq [1.25, 7.5]")
    save, restore = worker_outputs("new", "ddp", 1, "/tmp/new-tree", restored_step=7)
    row = checkpoint.row_figures(checkpoint.DistRow("new", "ddp", 1), Path("/tmp/new-tree"), save, restore)
    assert not row.restored_ok and row.check == "restored step 7, saved 9"
    with pytest.raises(RuntimeError, match="imported elastic from /tmp/new-tree, not /tmp/today-tree"):
        checkpoint.row_figures(checkpoint.DistRow("today", "ddp", 1), Path("/tmp/today-tree"), save, restore)


def test_checkpoint_quick_compares_both_paths_at_one_and_two_ranks(capsys, monkeypatch, tmp_path):
    """`--quick`'s table from recorded worker outputs (the jobs and the git trees left out): a row per path,
    mode and world size, today's FSDP rows "not supported", and the bytes each restore read."""
    checkpoint = script("checkpoint")
    launched = []

    def measure_dist(row, tree, scratch, opts):
        launched.append((row.path, row.mode, row.ranks, opts.dist_model, opts.dist_saves, opts.dist_context))
        return checkpoint.row_figures(row, tree, *worker_outputs(row.path, row.mode, row.ranks, str(tree)))

    monkeypatch.setattr(checkpoint, "extract_tree", lambda ref, directory: directory)
    monkeypatch.setattr(checkpoint, "resolve", lambda ref: "2d2dad6")
    monkeypatch.setattr(checkpoint, "measure_dist", measure_dist)
    assert checkpoint.main(["--quick", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert launched == [(path, mode, ranks, "recipe", 2, 32) for ranks in (1, 2)
                        for path, mode in [("today", "ddp"), ("new", "ddp"), ("new", "fsdp")]]
    measured = {(path, mode, int(ranks)): values for path, mode, ranks, *values in DIST_ROW.findall(out)}
    assert set(measured) == {(path, mode, ranks) for ranks in (1, 2) for path, mode in
                             [("today", "ddp"), ("new", "ddp"), ("new", "fsdp")]}, out
    for (path, mode, ranks), values in measured.items():
        ckpt_mb, stall, sync, ratio, commit, restore, _read_mb, read_x, save_rss, restore_rss = map(float, values[:10])
        assert values[10] == "ok", out
        assert ckpt_mb > 0 and stall > 0 and sync > 0 and commit > 0 and restore > 0, out
        assert ratio == pytest.approx(stall / sync, rel=0.02, abs=2e-4), out
        assert read_x == (1 if path == "new" else ranks), f"{path} {mode} {ranks} read {read_x}x\n{out}"
        assert save_rss > 0 and restore_rss > 0, out
    # Today's path has no FSDP support, and the table says so instead of a number.
    assert re.findall(r"^today +fsdp +(\d+) +not supported", out, re.M) == ["1", "2"], out
    read = READ_LINE.findall(out)
    assert len(read) == 6, out
    for path, _mode, ranks, got, size in read:
        assert int(got) == int(size) * (1 if path == "new" else int(ranks))
    assert "today = 6ec689c's tree, new = 2d2dad6's tree" in out
    assert list(tmp_path.iterdir()) == []  # the scratch directory goes


def test_checkpoint_table_says_which_row_failed_and_which_restore_differs(capsys):
    checkpoint = script("checkpoint")
    failed = checkpoint.DistRow("new", "ddp", 2, error="save job failed, exit 1: RuntimeError: boom (whole output: x.log)")
    differs = checkpoint.row_figures(checkpoint.DistRow("new", "ddp", 1), Path("/t"),
                                     *worker_outputs("new", "ddp", 1, "/t", restored_step=7))
    checkpoint.report_dist([differs, failed, checkpoint.DistRow("today", "fsdp", 2, error=checkpoint.FSDP_TODAY)])
    out = capsys.readouterr().out
    assert re.search(r"^new +ddp +1 .* MISMATCH$", out, re.M), out
    assert re.search(r"^new +ddp +2 +FAILED \(below\)$", out, re.M), out
    assert "new ddp 1: restored state differs from the saved one: restored step 7, saved 9" in out
    assert "new ddp 2: save job failed, exit 1: RuntimeError: boom" in out
    assert re.search(r"^today +fsdp +2 +not supported", out, re.M) and out.count("not supported") == 1, out


def test_checkpoint_defaults_of_the_full_run_and_of_quick():
    checkpoint = script("checkpoint")

    def filled(*argv: str) -> tuple:
        o = checkpoint.fill_defaults(checkpoint.build_parser().parse_args(list(argv)))
        return o.configs, o.ranks, o.dist_model, o.dist_saves, o.dist_repeats, o.dist_context

    assert filled() == ("both", [1, 2, 4], "100m", 3, 3, 64)
    assert filled("--quick") == ("none", [1, 2], "recipe", 2, 1, 32)
    assert filled("--quick", "--ranks", "2", "--configs", "recipe") == ("recipe", [2], "recipe", 2, 1, 32)
    assert filled("--ranks", "none")[1] == []


def test_checkpoint_refuses_a_bad_flag_in_one_line(capsys):
    err = one_line(refused(capsys, lambda: script("checkpoint").main(["--configs", "huge"])))
    assert "error: argument --configs" in err


# -- recovery.py ----------------------------------------------------------------------------------------


def recovery_result(median: float, *, redone: list[int], sources: list[str], disk_bytes: list[int],
                    estimated: bool = False, joins: list[float] | None = None,
                    phases: dict[str, float] | None = None, stall: float | None = None) -> dict[str, Any]:
    """`measure_recovery`'s figures for one setting after one kill (goodput runs skipped); its time lost
    is the stall plus a steady step per step redone (0.25 s)."""
    stall = median / 2 if stall is None else stall
    lost = round(stall + 0.25 * redone[0], 2)
    return {
        "stall_s": [stall], "stall_median_s": stall, "time_lost_s": [lost], "lost_median_s": lost, "lost_worst_s": lost,
        "recovery_s": [median], "median_s": median, "worst_s": median, "unrecovered": 0, "failed_rounds": 0,
        "restarts_consumed": [1, 0], "median_phases_s": phases or {}, "redone": redone,
        "redone_estimated": estimated, "restore_sources": sources, "steps_paused": [median * 9.5],
        "disk_bytes": disk_bytes, "join_pause_s": joins or [],
    }


LINE = {"detected": 0.05, "restore_began": 0.4, "restored": 0.55, "step": 0.9, "first_step_s": 0.35, "steady_step_s": 0.25}
RECOVERY_RESULTS = {
    "default": {
        "ours": recovery_result(0.9, redone=[1], sources=["memory"], disk_bytes=[0], phases=LINE, stall=0.7),
        "ours-disk": recovery_result(4.1, redone=[4], sources=["disk"], disk_bytes=[10_402_816], estimated=True,
                                     stall=3.5),
        "ours-torch-rounds": recovery_result(5.6, redone=[1], sources=["peer"], disk_bytes=[0]),
        "ours-train-on": recovery_result(0.4, redone=[0], sources=["live"], disk_bytes=[0], joins=[0.84], stall=0.25),
    },
    "large": {"ours": recovery_result(6.0, redone=[0], sources=["memory"], disk_bytes=[0], stall=3.0)},
}
RECOVERY_COLUMNS = r" +(\d+\.\d)\*? +(\d+)\*? +([\d.]+) +(-|[\d.]+) +([\d.]+) +- +(.+)$"  # redone, max, paused, join, disk


def test_recovery_tables_time_line_and_ratios_per_model_size(capsys):
    recovery = script("recovery")
    recovery.report(RECOVERY_RESULTS, recovery.parse_args(["--ckpt-every", "5", "--goodput-seconds", "0"]))
    out = capsys.readouterr().out
    for size, by_setting in RECOVERY_RESULTS.items():
        for setting, r in by_setting.items():
            row = re.search(rf"^{size} +{setting} +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+) +(\d+) +(\d+)/(\d+) +-$",
                            out, flags=re.M)
            assert row, out
            assert (float(row.group(1)), float(row.group(3)), float(row.group(4)), row.group(6)) == (
                r["lost_median_s"], r["stall_median_s"], r["median_s"], "0"), "time lost first, then the stall"
    assert re.search(r"^checkpoint every 5 steps; steps redone per kill", out, re.M), out
    found = {s: re.search(rf"^default +{s}" + RECOVERY_COLUMNS, out, re.M) for s in RECOVERY_RESULTS["default"]}
    assert found["ours"].group(6) == "memory 1" and float(found["ours"].group(5)) == 0
    assert found["ours-disk"].group(6) == "disk 1" and float(found["ours-disk"].group(5)) == pytest.approx(10.4)
    assert re.search(r"^default +ours-disk +4\.0\* +4\* ", out, re.M), out  # no keeper: from the event log
    assert found["ours-torch-rounds"].group(6) == "peer 1"
    train_on = found["ours-train-on"]
    assert train_on.group(6) == "live 1" and train_on.group(1) == "0.0" and train_on.group(4) == "0.84", out
    assert re.search(r"^default: median time lost, ours-disk / ours: 4\.7x$", out, re.M), out  # 4.5 / 0.95
    assert re.search(r"^default: median time lost, ours / ours-train-on: 3\.8x$", out, re.M), out  # 0.95 / 0.25
    assert not re.search(r"^large: median time lost", out, re.M), "one setting at that size: nothing to compare"
    line = re.search(r"^default ours: median time line after a kill: detected at ([\d.]+) s, restore began at ([\d.]+) s, "
                     r"restored at ([\d.]+) s, step at ([\d.]+) s; the first step took ([\d.]+) s, a steady one ([\d.]+) s$",
                     out, flags=re.M)
    assert line and [float(x) for x in line.groups()] == list(LINE.values()), out
    assert not re.search(r"^default ours-torch-rounds: median time line", out, re.M)  # no time line: no line
    assert json.loads(out.strip().splitlines()[-1]) == RECOVERY_RESULTS


def test_a_kills_time_line_from_the_event_log_and_its_cost_with_the_steps_it_redid():
    recovery = script("recovery")
    steps = [{"event": "step", "step": s, "time": 10.0 + s * 0.25, "world_size": 2} for s in range(1, 21)]
    killed_at = 15.1  # during step 21: step 20 ended at 15.0
    heal = [{"event": "failure", "step": 21, "time": 15.15},
            {"event": "restore", "step": 20, "time": 15.5, "seconds": 0.1, "redone": 0, "source": "live"},
            {"event": "heal", "step": 20, "time": 15.5},
            {"event": "step", "step": 21, "time": 15.85}, {"event": "step", "step": 22, "time": 16.1}]
    line = recovery.kill_time_line(steps + heal, [], killed_at)
    assert line == pytest.approx({"steady_step_s": 0.25, "detected": 0.05, "restore_began": 0.3, "restored": 0.4,
                                  "step": 0.75, "first_step_s": 0.35})
    # Rank 0 killed: its line of step 20 never went out (written one step late); the restore says the job had
    # completed it, so it counts as ended a steady step after step 19's line.
    line = recovery.kill_time_line(steps[:-1] + heal, [(15.2, "[default] Worker group FAILED. will restart worker group")],
                                   killed_at)
    assert line["first_step_s"] == pytest.approx(0.35) and line["detected"] == pytest.approx(0.05)
    # A restart from an older snapshot: the steps it redoes are no column of their own: they are time lost.
    restart = [{"event": "restore", "step": 18, "time": 16.0, "seconds": 0.2, "redone": 2, "source": "memory"},
               {"event": "start", "step": 18, "time": 16.0},
               *[{"event": "step", "step": s, "time": 16.4 + (s - 19) * 0.25, "world_size": 2} for s in range(19, 30)]]
    line = recovery.kill_time_line(steps + restart, [(15.3, "will restart worker group")], killed_at)
    assert line["detected"] == pytest.approx(0.2)
    cost = script("soak_measure").measure(steps + restart, kind="mid_step", kills=[{"time": killed_at}], full=2,
                                          d=line["steady_step_s"])
    assert cost.stall_s == pytest.approx(1.4 - 0.25) and cost.time_lost_s == pytest.approx(1.4 - 0.25 + 2 * 0.25)
    assert recovery.kill_time_line(steps, [], killed_at) is None, "not trained again yet"


class RecordedJob:
    def __init__(self, records: list[dict]) -> None:
        self._records = records

    def records(self) -> list[dict]:
        return self._records


def test_recovery_steps_redone_from_the_restore_event_or_from_the_log():
    recovery = script("recovery")
    steps = [{"event": "step", "step": s, "time": 10.0 + s * 0.1, "world_size": 2} for s in range(1, 31)]
    killed_at = 12.35  # after step 23's event

    def restore(**fields: Any) -> list[dict]:
        return [*steps, {"event": "restore", "time": 14.0, **fields}]

    memory = recovery.steps_redone(RecordedJob(restore(step=23, source="memory", redone=1)), killed_at, 15.0)
    assert memory == {"redone": 1, "estimated": False, "source": "memory", "restored_step": 23, "before": 23,
                      "disk_bytes": 0}
    disk = recovery.steps_redone(RecordedJob(restore(step=20, source="disk", bytes_read=10_402_816)), killed_at, 15.0)
    assert disk == {"redone": 3, "estimated": True, "source": "disk", "restored_step": 20, "before": 23,
                    "disk_bytes": 10_402_816}
    none = recovery.steps_redone(RecordedJob(steps), killed_at, 15.0)
    assert (none["redone"], none["source"], none["estimated"]) == (23, "none", True)
    late = recovery.steps_redone(RecordedJob(restore(step=20, source="disk")), killed_at, 13.9)  # after recovery
    assert late["source"] == "none"


def test_recovery_goodput_keeps_each_step_once_at_its_last_world_size():
    recovery = script("recovery")
    records = [{"event": "step", "step": s, "world_size": 2, "time": float(s)} for s in range(1, 8)]
    records += [{"event": "step", "step": s, "world_size": 1, "time": 8.0 + s} for s in (5, 6)]  # redone at 1
    assert recovery.kept_steps(records, after=2, until=100.0) == {3: 2, 4: 2, 5: 1, 6: 1, 7: 2}
    assert recovery.kept_steps(records, after=2, until=5.0) == {3: 2, 4: 2, 5: 2}


def test_recovery_refuses_unknown_settings(capsys):
    err = one_line(refused(capsys, lambda: script("recovery").main(["--settings", "fast"])))
    assert "--settings takes stock, ours" in err


# -- state_walk.py ----------------------------------------------------------------------------------------


def test_state_walk_rows_give_both_medians_and_dcp_over_ours():
    state_walk = script("state_walk")
    rows = [state_walk.row("recipe", "save", 0.412, 3.871), state_walk.row("recipe", "restore", 1.204, 6.02)]
    found = [re.fullmatch(r"recipe +(save|restore) +([\d.]+) +([\d.]+) +([\d.]+)", row) for row in rows]
    assert [m.group(1) for m in found] == ["save", "restore"], rows
    assert [m.groups()[1:] for m in found] == [("0.412", "3.871", "9.4"), ("1.204", "6.020", "5.0")]
    assert state_walk.HEADER.split() == ["model", "side", "ours", "ms", "DCP", "ms", "DCP/ours"]


# -- snapshot_auth.py and peer_fetch.py --------------------------------------------------------------------


def test_snapshot_auth_lines_give_signed_unsigned_and_their_ratio():
    snapshot_auth = script("snapshot_auth")
    opts = SimpleNamespace(restore_mb=8, part_mb=2, pairs=1)
    results = {True: [{"restore_s": 0.0412, "push_s": 0.0131}], False: [{"restore_s": 0.0255, "push_s": 0.0104}]}
    lines = snapshot_auth.report(opts, results, [0.0021, 0.0019, 0.0020])
    assert lines[0] == "snapshot traffic, signed vs not (1 pairs, medians):"
    for what, off_on in (("restore, 8 MB from a peer keeper", 0.0255 / 0.0412),
                         ("snapshot copy to the peer, 2 MB part", 0.0104 / 0.0131)):
        (line,) = [x for x in lines if what in x]
        assert "signed" in line and "unsigned / signed" in line and float(line.rsplit(" ", 1)[1]) > 0
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(off_on, abs=5e-4)
    assert f"{8 * 2**20 / 0.0412 / 1e9:.2f} GB/s" in lines[1]
    assert lines[-1] == "  for scale: a local memory copy of 8 MB takes 0.002 s"


def test_snapshot_auth_refuses_no_pairs(capsys):
    err = refused(capsys, lambda: script("snapshot_auth").main(["--pairs", "0"]))
    assert err.splitlines()[-1].endswith("error: --restore-mb, --part-mb and --pairs must be at least 1"), err


def test_peer_fetch_lines_give_both_sides_connections_and_ratios():
    peer_fetch = script("peer_fetch")
    opts = SimpleNamespace(mb=4, range_kb=256, rounds=1)
    lines = peer_fetch.report(opts, {"fresh": [0.0321], "kept": [0.0088]}, [0.0007], [1])
    text = "\n".join(lines)
    assert re.search(r"^  connection per range +[\d.]+ s +[\d.]+ GB/s +16 connections$", text, re.M), text
    assert re.search(r"^  kept connections +[\d.]+ s +[\d.]+ GB/s +1 connection\(s\)$", text, re.M), text
    assert re.search(r"^kept / per range: 3\.65x faster; kept / memory copy: 0\.080 of its speed$", text, re.M), text
    assert lines[0] == "4 MB from a peer keeper in 16 signed range requests of 256 KB (1 rounds, medians):"
    assert "2 connection(s)" in peer_fetch.report(opts, {"fresh": [0.03], "kept": [0.01]}, [0.001], [1, 2])[2]


# -- hf_resume.py -----------------------------------------------------------------------------------------


def test_hf_resume_table_says_redone_recovery_identity_and_the_audit():
    hf_resume = script("hf_resume")
    args = hf_resume.parse_args(["--steps", "32", "--save-steps", "5", "--kill-at", "12"])
    results = [
        {"system": "ours/torchrun", "exit_after_kill": 0, "steps_redone": 3, "recovery_s": 6.42,
         "final_weights_identical": True, "resize_exit": 0,
         "resize_audit": {"passes": 1, "samples_wrong": 0, "resumed_from": 10}, "seconds": 41.0},
        {"system": "stock/torchrun", "exit_after_kill": None, "steps_redone": None, "recovery_s": None,
         "final_weights_identical": False, "resize_exit": 1, "resize_audit": None, "seconds": 300.0},
    ]
    lines = hf_resume.report(results, args, 247)
    assert lines[0] == "\n32 steps, save_steps 5, 2 workers, a SIGKILL at step 12; 247 samples"
    assert re.fullmatch(r"ours/torchrun +3 +6\.4s +yes +0 in 1 pass\(es\)", lines[2]), lines
    assert re.fullmatch(r"stock/torchrun +- +never \(hung\) +no +exit 1", lines[3]), lines


def write_samples(prefix: Path, rows: list[tuple[float, int, int, int, list[int]]]) -> None:
    """Sample logs as hf_resume_common.logged writes them: (time, rank, restart, step, sample ids)."""
    for t, rank, restart, step, samples in rows:
        with open(f"{prefix}.rank{rank}", "a") as log:
            log.write(json.dumps({"time": t, "rank": rank, "world": 2, "restart": restart, "step": step,
                                  "samples": samples}) + "\n")


def test_hf_resume_reads_the_steps_redone_and_audits_the_samples_of_the_surviving_history(tmp_path):
    hf_resume = script("hf_resume")
    kill = tmp_path / "samples-kill"
    write_samples(kill, [(1.0 + s, r, 0, s, [2 * s + r]) for s in range(1, 14) for r in (0, 1)])  # killed at 13
    write_samples(kill, [(30.0 + s, r, 1, s, [2 * s + r]) for s in range(11, 17) for r in (0, 1)])  # resumed at 11
    before, first, started = hf_resume.after_kill(kill)
    assert (before, first, started) == (13, 11, 41.0)
    assert before - first + 1 == 3  # what measure() prints as steps redone
    never = tmp_path / "samples-never"
    write_samples(never, [(1.0, 0, 0, 1, [0])])
    assert hf_resume.after_kill(never) is None

    # The resize's audit: the first launch (2 ranks, a sample each a step) is killed after step 5; the second
    # (1 rank) resumes from step 2's save. What survives: steps 1-2 of the first, then steps 3-14 of the
    # second, 16 samples: two passes over 8 samples, each sample once a pass.
    num_samples = 8
    stream = [3, 6, 1, 0, 7, 2, 5, 4] + [2, 5, 7, 0, 6, 1, 4, 3]
    first_launch, second_launch = tmp_path / "samples-before-resize", tmp_path / "samples-after-resize"
    write_samples(first_launch, [(float(s), r, 0, s, [stream[2 * (s - 1) + r]]) for s in (1, 2) for r in (0, 1)])
    write_samples(first_launch, [(float(s), r, 0, s, [s + r]) for s in (3, 4, 5) for r in (0, 1)])  # trained again
    write_samples(second_launch, [(10.0 + s, 0, 0, s, [stream[s + 1]]) for s in range(3, 15)])
    assert hf_resume.exactly_once(first_launch, second_launch, num_samples) == {
        "passes": 2, "samples_wrong": 0, "resumed_from": 2}
    write_samples(second_launch, [(30.0, 0, 0, 15, [3])])  # a third pass begun: not complete, not audited
    assert hf_resume.exactly_once(first_launch, second_launch, num_samples)["passes"] == 2
    twice = tmp_path / "samples-twice"
    write_samples(twice, [(10.0 + s, 0, 0, s, [stream[s + 1] if s != 4 else stream[4]]) for s in range(3, 15)])
    assert hf_resume.exactly_once(first_launch, twice, num_samples)["samples_wrong"] == 2  # 7 twice, 2 never
    empty = tmp_path / "samples-empty"
    with pytest.raises(RuntimeError, match="the launch after the resize trained no step"):
        hf_resume.exactly_once(first_launch, empty, num_samples)


def test_hf_resume_refuses_an_unknown_system_in_one_line(capsys):
    err = one_line(refused(capsys, lambda: script("hf_resume").main(["--systems", "fast"])))
    assert "unknown system" in err


# -- slurm_preemption.py -----------------------------------------------------------------------------------


def test_slurm_preemption_prints_both_systems_side_by_side():
    slurm_preemption = script("slurm_preemption")
    opts = slurm_preemption.parse_args(["--runs", "1", "--ckpt-every", "4", "--step-seconds", "0.2"])
    results = {
        "torchrevive": [{"signalled": 6, "trained": 8, "resumed": 8, "redone": 0, "seconds": 2.3, "came_back": True}],
        "stock": [{"signalled": 6, "trained": 6, "resumed": 4, "redone": 2, "seconds": 0.4, "came_back": False}],
    }
    lines = slurm_preemption.report(results, opts)
    assert lines[0].startswith("GPT recipe, srun python x2 on a one-machine Slurm, checkpoints every 4 steps, "
                               "steps of 0.2 s") and lines[0].endswith("(1 runs):")
    rows = {k: v for k, v in re.findall(r"^  (torchrevive|stock) +(.*)$", "\n".join(lines), re.M)}
    assert set(rows) == {"torchrevive", "stock"}, lines
    assert re.search(r"steps after the signal median 2, steps redone median 0 .* came back by itself 1/1$",
                     rows["torchrevive"]), rows
    assert re.search(r"steps redone median 2 \(max 2\), signal to end median 0\.4 s, came back by itself 0/1$",
                     rows["stock"]), rows


# -- snapshot_restore.py ------------------------------------------------------------------------------------

NUMBER = r"(\d+\.\d+)"


def snapshot_figures(*, ok: bool = True, blocking: float = 0.00043) -> dict[str, Any]:
    """`measure`'s figures for the tiny GPT with --quick (one restore per source)."""
    return {"parameters": 110_912, "snapshot_mb": 1.3,
            "restore": {"memory": 0.0121, "disk (cached)": 0.0342, "disk (cold)": 0.0517},
            "step_off": 0.0151, "step_on": 0.0163, "steps": 2, "blocking": blocking, "blocking_max": 0.00061, "ok": ok}


def test_snapshot_restore_prints_a_memory_and_a_disk_restore_and_the_blocking_verdict(capsys):
    snapshot_restore = script("snapshot_restore")
    snapshot_restore.report({"tiny": snapshot_figures()}, 1)
    out = capsys.readouterr().out
    line = re.search(rf"^tiny: restore from memory {NUMBER} s, from disk {NUMBER} s \(page cache\), {NUMBER} s \(cold\); "
                     rf"disk/memory {NUMBER}x, cold/memory {NUMBER}x$", out, re.M)
    assert line and [float(x) for x in line.groups()] == [0.012, 0.034, 0.052, 2.8, 4.3], out
    row = re.search(rf"^tiny +[\d.]+M +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} .* (ok|MISMATCH)$", out, re.M)
    assert row and row.group(5) == "ok", out
    blocking = re.search(r"^tiny: snapshot blocking [\d.]+ ms .*: ([\d.]+) \(target <= 0\.02: (met|MISSED)\)", out, re.M)
    assert blocking and blocking.groups() == ("0.0285", "MISSED"), out
    snapshot_restore.report({"tiny": snapshot_figures(ok=False, blocking=0.0002)}, 1)
    out = capsys.readouterr().out
    assert re.search(r" MISMATCH$", out, re.M) and "(target <= 0.02: met)" in out, out
    assert "100m" not in out


def test_snapshot_restore_quick_is_the_tiny_model_only():
    snapshot_restore = script("snapshot_restore")
    parser = snapshot_restore.build_parser()
    assert [m.name for m in snapshot_restore.models(parser.parse_args(["--quick"]))] == ["tiny"]
    assert [m.name for m in snapshot_restore.models(parser.parse_args([]))] == ["tiny", "100m"]


def test_snapshot_restore_refuses_a_bad_flag_in_one_line(capsys):
    err = one_line(refused(capsys, lambda: script("snapshot_restore").main(["--models", "huge"])))
    assert "error: argument --models" in err


def test_object_store_table_gives_each_system_its_rates_and_its_ratio_to_the_sequential_upload(capsys) -> None:
    bench = script("object_store")
    # 256 MB: ours 3 and 4 s up (median 3.5), 2 s down; sequential 2.56 s up, 0.64 s down.
    text = bench.table(256, {"ours": [(3.0, 2.0), (4.0, 2.0)], "sequential": [(2.56, 0.64)], "dcp-fsspec": [(5.12, 3.2)]})
    assert text.splitlines()[2:] == [
        "| ours | 73 | 128 | 0.73x | 0.32x |",
        "| sequential | 100 | 400 | 1.00x | 1.00x |",
        "| dcp-fsspec | 50 | 80 | 0.50x | 0.20x |",
    ]
    assert "upload vs sequential" not in bench.table(1, {"ours": [(1.0, 1.0)]}).splitlines()[2]
    assert "unknown nosuch" in refused(capsys, lambda: bench.main(["--systems", "ours,nosuch"]))


def test_object_store_soak_verdict_names_every_loss() -> None:
    soak = script("object_store_soak")
    good = [{"restored": 0, "committed_before": [], "corrupt": []},
            {"restored": 4, "committed_before": [2, 4], "corrupt": []}]
    assert soak.verdict(good, True, []) == (True, [])
    ok, problems = soak.verdict(
        [*good, {"restored": 2, "committed_before": [2, 4, 6], "corrupt": ["checkpoint step_00000006 is corrupt (x)"]}],
        False, ["soak/step_00000008/t1/shard_00000.bin"],
    )
    assert not ok and problems == [
        "start 2 resumed from step 2, the newest committed was 6",
        "start 2 met a corrupt checkpoint: checkpoint step_00000006 is corrupt (x)",
        "the final checkpoint differs from the uninterrupted run's",
        "1 objects no committed manifest names, e.g. soak/step_00000008/t1/shard_00000.bin",
    ]


# -- seal_cost.py ---------------------------------------------------------------------------------------


def test_seal_cost_prints_medians_and_ratios_and_writes_them_with_their_provenance(capsys, monkeypatch, tmp_path):
    seal_cost = script("seal_cost")
    times = {"unsealed": [10.0, 12.0, 11.0], "sealed": [13.0, 12.1, 11.9]}
    rows = [seal_cost.row("rendezvous round, 4 agents", times), seal_cost.row("process group start, 4 ranks", times)]
    assert rows[0]["unsealed_ms"] == 11.0 and rows[0]["sealed_ms"] == 12.1 and rows[0]["ratio"] == 1.1
    monkeypatch.setattr(seal_cost, "measured_rows", lambda args: rows)
    monkeypatch.setattr(sys.modules[seal_cost.write_result.__module__], "_git", lambda *args: "a" * 40)  # no git here
    assert seal_cost.main(["--pairs", "3", "--json", str(tmp_path / "seal.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^rendezvous round, 4 agents +11\.00 +12\.10 +1\.100$", out, re.M), out
    document = script("provenance").read_result(tmp_path / "seal.json")
    assert document["benchmark"] == "seal_cost" and document["results"]["rows"] == rows
    assert document["provenance"]["command"] and document["provenance"]["torch"]


def test_seal_cost_refuses_what_it_cannot_measure(capsys):
    err = refused(capsys, lambda: script("seal_cost").parse_args(["--agents", "1"]))
    assert "--agents and --ranks take 2 to 64" in one_line(err.splitlines()[-1] + "\n")
