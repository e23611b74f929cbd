"""Each benchmark script runs end to end once, in its smallest form (tiny sizes; their figures are not
asserted: timings live in docs/results.md).

A run here checks what only a real run shows: the jobs it starts end well, and what they measured holds
(exact bytes read, restored states equal, processes counted, where a restore came from). The tables,
ratios, verdicts and refusals are checked on recorded measurements in tests/unit/test_benchmark_tables.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import warm
from support import REPO, worker_env

pytestmark = pytest.mark.slow


def test_overhead_benchmark_prints_the_loops_their_ratio_and_the_metrics_cost(tmp_path) -> None:
    """Also goodput_at_scale.py's one process: it reads the figure this run wrote (its tables, help and
    refusals: tests/unit)."""
    measured = tmp_path / "overhead.json"
    result = warm.run(
        [sys.executable, "benchmarks/overhead.py", "--blocks", "3", "--warmup", "2", "--batch-size", "4",
         "--ckpt-every", "3", "--scrape-interval", "0.05", "--json", str(measured)],
        timeout=240, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from elastic._worker.observe.step_costs import PHASES

    assert "per-step cost of the runtime on the loop" in result.stdout, result.stdout
    for phase in (*PHASES, "total", "end-to-end"):
        row = re.search(rf"^  {phase} +(( +[\d.-]+ ms +[\d.-]+%)+)", result.stdout, re.M)
        assert row and len(re.findall(r"ms", row.group(1))) == 3, (phase, result.stdout)  # the three recipe loops
    # Snapshots at their default: as often as 1 % of the loop buys on this machine now, at most --ckpt-every apart.
    # (Each loop measures auto's interval itself: on a busy machine two loops may settle on two, "every 2/3 steps".)
    assert re.search(r"snapshots auto \(every [123](/[123])* steps at the end\)", result.stdout), result.stdout
    overhead = json.loads(measured.read_text())["results"]
    assert 0 <= overhead["loop_overhead"] < 1
    # The snapshots' own account, from the workers' records: every loop with snapshots took some and made
    # its buffers once (two slots, the loop's copies), whatever the machine's speed.
    for name in ("recipe", "recipe_no_metrics"):
        taken = overhead["snapshots"][name]
        assert taken["snapshots"] > 0 and taken["disabled"] is None and taken["cpu_seconds"] > 0, taken
    assert re.search(r"^snapshot cost per step, end to end \(snapshots on / off", result.stdout, re.M), result.stdout
    goodput = warm.run([sys.executable, "benchmarks/goodput_at_scale.py", "--measured", str(measured)],
                             timeout=60, cwd=REPO)
    assert goodput.returncode == 0 and f"from --measured {measured}" in goodput.stdout, goodput.stderr
    ci = r"\[95% CI ([\d.]+)-([\d.]+)\]"
    ratios = re.findall(rf"recipe/gpt.py [\d.]+ steps/s \| seed-style DDP [\d.]+ steps/s \| ratio ([\d.]+) {ci}", result.stdout)
    assert len(ratios) == 2, result.stdout  # by 1/median step and by steps/seconds
    on_off = re.search(rf"^metrics on / off: ([\d.]+) {ci} \(1/median step\)", result.stdout, re.M)
    assert on_off, result.stdout
    for ratio, low, high in [*ratios, on_off.groups()]:
        assert float(low) <= float(ratio) <= float(high), result.stdout
    assert re.search(r"^target ratio >= 0.99, 95% interval above 0.98, default settings: (met|MISSED|not resolved)",
                     result.stdout, re.M), result.stdout
    assert re.search(r"an interval of \+-1 % needs --blocks \d+ \(about \d+ min\)$", result.stdout, re.M), result.stdout
    saves = re.search(r"^checkpoint every 3 steps: (\d+) saves", result.stdout, re.M)
    assert saves and int(saves.group(1)) > 0, result.stdout
    scraped = re.search(r"^metrics scraped (\d+) times", result.stdout, re.M)
    assert scraped and int(scraped.group(1)) > 0, "the recipe's workers served no scrape"


def test_control_cost_benchmark_prints_what_each_vote_adds() -> None:
    """One world size (a row per world size, in order, is checked on recorded means in the unit tier)."""
    result = warm.run(
        [sys.executable, "benchmarks/control_cost.py", "--ranks", "2", "--blocks", "2", "--block-steps", "2",
         "--width", "16"],
        timeout=240, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^ +(\d+) +[\d.]+ ms +-?\d+ us +-?[\d.]+% +-?\d+ us +-?[\d.]+%$", result.stdout, re.M)
    assert rows == ["2"], result.stdout


def test_checkpoint_benchmark_measures_the_stall_and_compares_todays_rank0_path_with_the_sharded_one(tmp_path: Path) -> None:
    """One run for both parts: the stall ratio of the tiny recipe model in this process, and the rank
    comparison as --quick runs it (recipe GPT, 2 saves) at 2 ranks, where today's path reads the checkpoint
    once per rank and the new one once per job (--quick's 1 and 2 ranks: tests/unit)."""
    result = warm.run(
        [sys.executable, "benchmarks/checkpoint.py", "--tiny", "--configs", "recipe", "--saves", "2", "--repeats", "1",
         "--warmup-steps", "1", "--every", "1", "--quick", "--ranks", "2", "--json", str(tmp_path / "checkpoint.json")],
        timeout=280, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(r"^recipe: checkpoint stall ratio (\S+) \(target <= 0\.05: (met|MISSED)\)$", result.stdout, re.M)
    assert match, result.stdout
    written = json.loads((tmp_path / "checkpoint.json").read_text())
    assert written["benchmark"] == "checkpoint" and written["provenance"]["command"].endswith("checkpoint.json")
    assert f"{written['results']['configs']['recipe']['ratio']:.4f}" == match.group(1), "the result file is what it printed"
    assert {(row["path"], row["mode"], row["ranks"]) for row in written["results"]["ranks"]} == {
        ("today", "ddp", 2), ("today", "fsdp", 2), ("new", "ddp", 2), ("new", "fsdp", 2)}
    number = r"([\d.]+)"
    rows = re.findall(
        rf"^(today|new) +(ddp|fsdp) +(\d+) +{number} +{number} +{number} +{number} +{number} +{number} +{number} "
        rf"+{number}x +{number} +{number} +(ok|MISMATCH)$",
        result.stdout, re.M,
    )
    measured = {(path, mode, int(ranks)): values for path, mode, ranks, *values in rows}
    assert set(measured) == {("today", "ddp", 2), ("new", "ddp", 2), ("new", "fsdp", 2)}, result.stdout
    for (path, mode, ranks), values in measured.items():
        ckpt_mb, stall, sync, ratio, commit, restore, _read_mb, read_x, save_rss, restore_rss = map(float, values[:10])
        assert values[10] == "ok", f"{path} {mode} {ranks}: the restored state is not the saved one\n{result.stdout}"
        assert ckpt_mb > 0 and stall > 0 and sync > 0 and commit > 0 and restore > 0, result.stdout
        assert ratio == pytest.approx(stall / sync, rel=0.02, abs=2e-4), result.stdout
        assert read_x == (1 if path == "new" else ranks), f"{path} {mode} {ranks} read {read_x}x\n{result.stdout}"
        assert save_rss > 0 and restore_rss > 0, result.stdout
    # Today's path has no FSDP support, and the table says so instead of a number.
    assert re.findall(r"^today +fsdp +(\d+) +not supported", result.stdout, re.M) == ["2"], result.stdout
    # Exact bytes read on restore, summed over ranks: the new path reads the checkpoint once per job,
    # today's path once per rank.
    read = re.findall(r"^(today|new) (ddp|fsdp) (\d+): restore read (\d+) bytes over \d+ ranks, checkpoint (\d+) bytes",
                      result.stdout, re.M)
    assert len(read) == 3, result.stdout
    for path, mode, ranks, got, checkpoint in read:
        assert int(got) == int(checkpoint) * (1 if path == "new" else int(ranks)), f"{path} {mode} {ranks}"


def test_recovery_benchmark_measures_the_time_a_kill_loses_restarting_healing_and_training_on(tmp_path: Path) -> None:
    """recovery.py in its quick form: one kill under each survivors setting at the tiny size, in the
    default settings (three jobs; the soak's short form covers the moments a kill lands at)."""
    quick = ["--kills", "1", "--settle", "1", "--goodput-seconds", "0", "--recovery-limit", "120", "--ckpt-every", "5",
             "--pictures", str(tmp_path), "--sizes", "tiny", "--settings", "ours,ours-keep,ours-train-on",
             "--json", str(tmp_path / "recovery.json")]
    done = warm.run([sys.executable, "benchmarks/recovery.py", *quick], timeout=400, cwd=REPO, env=worker_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    columns = r" +(\d+\.\d)\*? +(\d+)\*? +([\d.]+) +(-|[\d.]+) +([\d.]+) +- +(.+)$"  # redone, max, paused, join, disk
    for setting in ("ours", "ours-keep", "ours-train-on"):
        row = re.search(rf"^tiny +{setting} +([\d.-]+) +([\d.-]+) +([\d.]+) +([\d.]+) +([\d.]+) +(\d+) +(\d+)/(\d+) +-$",
                        out, flags=re.M)
        assert row, out
        lost, stall, kill_to_step = float(row.group(1)), float(row.group(3)), float(row.group(4))
        assert -1 < stall <= lost + 0.5 < 120 and kill_to_step < 120 and row.group(6) == "0", "no rendezvous round failed"
        line = re.search(rf"^tiny {setting}: median time line after a kill: (?:detected at ([\d.]+) s, )?restore "
                         r"began at ([\d.]+) s, restored at ([\d.]+) s, step at ([\d.]+) s; the first step took "
                         r"([\d.]+) s, a steady one ([\d.]+) s$", out, flags=re.M)
        assert line, out
        marks = [float(x) for x in line.groups()[:4] if x is not None]
        assert marks == sorted(marks) and marks[-1] == kill_to_step, "the marks follow each other up to the step"
        assert (tmp_path / f"tiny-{setting}-recovery.png").read_bytes().startswith(b"\x89PNG"), "no picture drawn"
        found = re.search(rf"^tiny +{setting}" + columns, out, re.M)
        assert found and float(found.group(5)) == 0, "restored from memory or a live peer: nothing read from disk"
        # A heal or a shrink takes a live member's state; a new round the snapshot of its node's keeper (or a peer's).
        assert re.fullmatch(r"(memory|peer) 1" if setting == "ours" else "live 1", found.group(6)), out
        assert setting == "ours" or found.group(1) == "0.0", "a heal in place or training on redoes no step"
    assert re.search(r"^checkpoint every 5 steps; steps redone per kill", out, re.M), out
    assert re.search(r"^tiny +ours-train-on" + columns, out, re.M).group(4) != "-", "the join's pause measured"
    # (a train-on kill on 2 cores may lose nothing or less: one rank alone runs faster per sample than two
    # side by side, so its time lost can be 0 or below, and the ratio is "-" then)
    assert re.search(r"^tiny: median time lost, ours / ours-train-on: ([\d.]+x|-)$", out, re.M), out
    written = json.loads((tmp_path / "recovery.json").read_text())
    assert written["benchmark"] == "recovery" and written["results"]["kills"] == 1
    assert set(written["results"]["sizes"]["tiny"]) == {"ours", "ours-keep", "ours-train-on"}
    assert written["results"]["sizes"]["tiny"]["ours-keep"]["restore_sources"] == ["live"]


def test_the_docs_figures_render_from_the_result_files_as_a_script() -> None:
    """`python benchmarks/render.py --check`, as the docs say to run it: its views register in the script
    itself (run as __main__, a second copy of render.py once knew no view)."""
    done = warm.run([sys.executable, "benchmarks/render.py", "--check"], timeout=60, cwd=REPO, env=worker_env())
    assert done.returncode == 0, done.stdout + done.stderr


def test_state_walk_benchmark_prints_ours_against_dcps() -> None:
    result = warm.run(
        [sys.executable, "benchmarks/state_walk.py", "--models", "recipe", "--repeats", "1"],
        timeout=120, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^recipe +(save|restore) +([\d.]+) +([\d.]+) +([\d.]+)$", result.stdout, re.M)
    assert [side for side, *_ in rows] == ["save", "restore"], result.stdout


def test_object_store_benchmark_prints_ours_the_sequential_upload_and_dcps_fsspec_writer(tmp_path: Path) -> None:
    result = warm.run(
        [sys.executable, "benchmarks/object_store.py", "--mb", "8", "--tensors", "4", "--repeats", "1",
         "--json", str(tmp_path / "object_store.json")],
        timeout=180, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (ours|sequential|dcp-fsspec) \| (\d+) \| (\d+) \| ([\d.]+)x \| ([\d.]+)x \|$",
                      result.stdout, re.M)
    assert [name for name, *_ in rows] == ["ours", "sequential", "dcp-fsspec"], result.stdout
    written = json.loads((tmp_path / "object_store.json").read_text())["results"]
    assert {name: f"{figures['upload_mb_s']:.0f}" for name, figures in written["systems"].items()} == {
        name: upload for name, upload, *_ in rows}, "the result file is what it printed"
    assert all(int(up) > 0 and int(down) > 0 for _, up, down, *_ in rows)
    assert rows[1][3:] == ("1.00", "1.00"), "the sequential upload is the baseline"


def test_snapshot_auth_benchmark_prints_signed_against_unsigned() -> None:
    result = warm.run(
        [sys.executable, "benchmarks/snapshot_auth.py", "--restore-mb", "8", "--part-mb", "2", "--pairs", "1"],
        timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for what in ("restore, 8 MB from a peer keeper", "snapshot copy to the peer, 2 MB part"):
        (line,) = [x for x in lines if what in x]
        assert "signed" in line and "unsigned / signed" in line and float(line.rsplit(" ", 1)[1]) > 0


def test_seal_cost_benchmark_prints_sealed_against_unsealed_and_writes_its_figures(tmp_path: Path) -> None:
    result = warm.run(
        [sys.executable, "benchmarks/seal_cost.py", "--agents", "2", "--ranks", "2", "--pairs", "1",
         "--json", str(tmp_path / "seal.json")], timeout=300, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for what in ("rendezvous round, 2 agents", "process group start, 2 ranks"):
        (line,) = [x for x in result.stdout.splitlines() if x.startswith(what)]
        assert float(line.rsplit(" ", 1)[1]) > 0
    rows = json.loads((tmp_path / "seal.json").read_text())["results"]["rows"]
    assert [len(r["samples"]["sealed"]) for r in rows] == [1, 1]


def test_hf_resume_benchmark_audits_the_elastic_trainer_under_plain_torchrun(tmp_path: Path) -> None:
    """Plain torchrun restarts the group in the same shared store: the ported script must resume (its
    group is made through the runtime's fresh namespace), end identical and keep the samples exactly once.
    32 steps: the second launch completes a pass over the 247 samples whatever save it resumed from."""
    result = warm.run(
        [sys.executable, "benchmarks/hf_resume.py", "--systems", "ours/torchrun", "--steps", "32", "--save-steps", "5",
         "--kill-at", "12", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json")],
        timeout=600, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["benchmark"] == "hf_resume" and written["results"]["kill_at"] == 12
    (row,) = written["results"]["results"]
    assert row["final_weights_identical"] and row["resize_audit"]["samples_wrong"] == 0
    # Killed at step 12 or a little later, with saves every 5 steps (one may still be in flight): what the
    # restarted group trains again lies between 1 step and every step since the save before the last.
    assert row["resize_audit"]["passes"] >= 1 and 1 <= row["steps_redone"] <= 16
    assert "ours/torchrun" in result.stdout


def test_slurm_preemption_benchmark_prints_both_systems_side_by_side() -> None:
    result = warm.run(
        [sys.executable, "benchmarks/slurm_preemption.py", "--runs", "1", "--ckpt-every", "4", "--step-seconds", "0.2"],
        timeout=600, cwd=REPO, env=worker_env(),
    )
    if "Slurm is not installed" in result.stderr or "slurmd must run as root" in result.stderr:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {k: v for k, v in re.findall(r"^  (torchrevive|stock) +(.*)$", result.stdout, re.M)}
    assert set(rows) == {"torchrevive", "stock"}, result.stdout
    assert re.search(r"steps redone median 0 .* came back by itself 1/1$", rows["torchrevive"]), result.stdout
    assert re.search(r"came back by itself 0/1$", rows["stock"]), result.stdout


def test_peer_fetch_benchmark_compares_kept_connections_with_one_per_range() -> None:
    result = warm.run(
        [sys.executable, "benchmarks/peer_fetch.py", "--mb", "4", "--range-kb", "256", "--rounds", "1"],
        timeout=300, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert re.search(r"^  connection per range +[\d.]+ s +[\d.]+ GB/s +16 connections$", result.stdout, re.M), result.stdout
    assert re.search(r"^  kept connections +[\d.]+ s +[\d.]+ GB/s +1 connection\(s\)$", result.stdout, re.M), result.stdout
    assert re.search(r"^kept / per range: [\d.]+x faster; kept / memory copy: [\d.]+ of its speed$", result.stdout, re.M)


def test_gpu_check_dry_run_takes_every_path_cpu_allows_and_reports_the_cuda_ones_skipped(tmp_path: Path) -> None:
    """Four small jobs of the GPT recipe under torchrevive-run, on gloo: 2 workers timed, a worker
    SIGKILLed and its run compared bit for bit with an uninterrupted one, a hung worker. The figures'
    arithmetic, the summary's lines and the refusals: tests/unit/test_gpu_check.py."""
    out = tmp_path / "gpu-check.json"
    result = warm.run(
        [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--json", str(out), "--workdir", str(tmp_path / "work")],
        timeout=300, cwd=REPO, env=worker_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    parts = figures["parts"]
    assert figures["dry_run"] is True and figures["device"]["peak_bf16_tflops"] is None
    for name in ("ddp-gpu", "fsdp-gpu", "snapshot-copy", "snapshot-stall", "small-model"):
        assert parts[name] == {"status": "skipped", "reason": "needs CUDA (dry run on CPU)"}, name
    assert parts["fsdp-2"]["status"] == "skipped"
    timed = parts["ddp-2"]
    assert timed["status"] == "ok" and timed["world_size"] == 2 and timed["steps_per_s"] > 0 and timed["mfu"] is None
    assert timed["tokens_per_step"] == 2 * 8 * 32  # 2 ranks x batch 8 x 32-token windows: what the job ran
    kill = parts["kill"]
    assert kill["status"] == "ok" and kill["kill_to_step_s"] > 0, kill
    assert kill["restore_source"] == "memory" and kill["restored_step"] <= kill["killed_at_step"] == 4, kill
    assert kill["final_step"] == 8
    exact = parts["exactness"]
    assert exact["status"] == "ok" and exact["identical"] is True and exact["tensors"] > 50, exact
    assert exact["checkpoint"] == "step_00000008" and exact["nondeterministic_ops"] == []
    hang = parts["hang"]
    assert hang["status"] == "ok" and hang["world_size"] == 2 and hang["hung_rank"] == 1, hang
    assert hang["hang_to_step_s"] > 0 and hang["restore_source"] == "memory", hang
    # What ended the hung group: hang naming's culprit ended by its agent, or, failing that, the watchdog.
    first = hang["abort_evidence"][0]
    assert first.startswith("watchdog:") or "the hang's culprit, so that" in first, hang
    # The summary: the device, a line per part as the JSON has it, then the count of failures.
    lines = result.stdout.splitlines()
    assert "gpu check on CPU (dry run, CPU); peak bf16 unknown: no GPU: no MFU" in lines, result.stdout
    for name, part in parts.items():
        assert any(re.match(rf"^  {re.escape(name)} +{part['status']} ", line) for line in lines), (name, result.stdout)
    assert re.search(r"^  kill +ok +kill to step [\d.]+ s, restored from memory$", result.stdout, re.M), result.stdout
    assert lines[-1] == f"0 part(s) failed; every figure: {out}"
