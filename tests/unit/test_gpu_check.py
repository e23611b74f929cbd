"""benchmarks/gpu_check.py's figures from recorded inputs: the GPU peak table, MFU as nanoGPT computes
it, step rates and recoveries from event logs, a failed job's one-line reason, the bit-for-bit
comparison of two checkpoints, the summary, the snapshot copy on CPU, and its refusals.

Its jobs run once, as `--dry-run`, in tests/integration/test_benchmarks.py.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import ClassVar

import pytest
import torch
from support import REPO


def load_gpu_check() -> ModuleType:
    module = sys.modules.get("gpu_check")
    if module is None:
        spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA H100 NVL", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("Tesla V100-SXM2-16GB", None),
])
def test_the_peak_is_looked_up_by_the_device_name_and_an_unknown_gpu_has_none(name, peak) -> None:
    assert gpu_check.peak_bf16_tflops(name) == peak


def test_mfu_is_the_models_flops_per_second_over_the_peak_of_the_gpus_used() -> None:
    # nanoGPT's estimate_mfu for GPT-2 small: N = 124M, L = H = 12, Q = 64, T = 1024.
    per_token = 6 * 124e6 + 12 * 12 * 12 * 64 * 1024
    one = gpu_check.model_flops_utilisation(per_token, 12 * 1024, 2.0, 312.0, 1)
    assert one == pytest.approx(per_token * 12 * 1024 * 2.0 / 312e12)
    assert gpu_check.model_flops_utilisation(per_token, 12 * 1024, 2.0, 312.0, 2) == pytest.approx(one / 2)


def test_the_large_model_has_about_125m_parameters_and_the_recipes_flop_count() -> None:
    parameters, per_token = gpu_check.flops_per_token(gpu_check.LARGE_MODEL)
    m = gpu_check.LARGE_MODEL
    assert 120e6 < parameters < 135e6
    non_embedding = parameters - m["block_size"] * m["n_embd"]  # nanoGPT leaves the position table out
    assert per_token == 6 * non_embedding + 12 * m["n_layer"] * m["n_embd"] * m["block_size"]


def step(n: int, t: float) -> dict:
    return {"event": "step", "step": n, "time": t, "world_size": 1}


def test_the_step_rate_leaves_out_the_warmup_steps_and_any_restarted_group() -> None:
    records = [{"event": "start", "step": 0, "time": 0.0}, step(1, 5.0), step(2, 5.1), step(3, 5.6), step(4, 6.1),
               step(5, 6.6), {"event": "start", "step": 5, "time": 9.0}, step(6, 20.0)]
    assert gpu_check.steps_per_second(records, warmup=2) == pytest.approx(2 / 1.0)  # steps 3 to 5
    assert gpu_check.steps_per_second(records, warmup=4) is None  # one step left to time
    assert gpu_check.steps_per_second([], warmup=0) is None


def test_a_recovery_ends_at_the_first_step_of_a_group_started_after_the_fault() -> None:
    records = [{"event": "start", "step": 0, "time": 0.0}, step(1, 1.0), step(2, 2.0),
               {"event": "restore", "step": 2, "time": 3.5, "source": "memory"},
               {"event": "start", "step": 2, "time": 3.5}, step(2, 3.6), step(3, 3.8)]
    assert gpu_check.first_step_after(records, 2.5) == step(3, 3.8)  # not a step the old group had finished
    assert gpu_check.restore_after(records, 2.5)["source"] == "memory"
    assert gpu_check.first_step_after(records, 4.0) is None and gpu_check.restore_after(records, 4.0) is None


def test_a_failed_jobs_reason_is_its_last_error_without_torchs_prefix_or_the_launchers_wrapper() -> None:
    log = "\n".join([
        "W1127 13:57:02.675000 29489 torch/distributed/run.py:982] starting",
        "E1127 13:57:02.675000 29489 torch/x/api.py:836]   File \"/work/x.py\", line 3, in <module>",
        "E1127 13:57:02.675000 29489 torch/x/api.py:836] torch.distributed.DistBackendError: NCCL error: invalid usage",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "",
    ])
    assert gpu_check.failure_reason(log) == "torch.distributed.DistBackendError: NCCL error: invalid usage"
    assert gpu_check.failure_reason("first\nlast line\n") == "last line"
    assert gpu_check.failure_reason("") == "no output"
    assert len(gpu_check.failure_reason("ValueError: " + "x" * 500)) == 240


def test_the_abort_evidence_is_the_logs_lines_about_aborts_and_the_watchdog_first() -> None:
    """The watchdog's line leads even behind more abort lines than the summary keeps (8): in the suite, a
    loaded machine's log put it ninth and the dry run's check of what ended the group failed."""
    log = ("step 3\n" + "[PG 0 Rank 0] ProcessGroupGloo aborting a pending operation\n" * 9
           + "watchdog: no training step completed for 10 s after step 40\n"
           "[PG 0 Rank 1] ProcessGroupNCCL aborting communicators\nfailed (exitcode: 124) local_rank: 1\nstep 41\n")
    lines = gpu_check.abort_lines(log)
    assert lines[0] == "watchdog: no training step completed for 10 s after step 40"
    assert lines[-2:] == ["[PG 0 Rank 1] ProcessGroupNCCL aborting communicators", "failed (exitcode: 124) local_rank: 1"]
    assert len(lines) == 12


def test_the_agent_ending_a_named_culprit_is_evidence_and_a_stack_frame_is_not() -> None:
    """In the suite, a dry run whose culprit was named and ended before the watchdog fired kept only a frame
    of the culprit's stack dump (`.../watchdog.py", line 150 in _watch`) as its evidence, or nothing."""
    log = ("hang: this rank (1) is named as the culprit; its Python stacks:\n"
           '  File "/x/elastic/_worker/control/watchdog.py", line 150 in _watch\n'
           "[PG 0 Rank 0] ProcessGroupGloo aborting a pending operation\n"
           "torchrevive-run: ending worker rank 1 (pid 2049), the hang's culprit, so that the job recovers from it now\n")
    assert gpu_check.abort_lines(log) == [
        "torchrevive-run: ending worker rank 1 (pid 2049), the hang's culprit, so that the job recovers from it now",
        "[PG 0 Rank 0] ProcessGroupGloo aborting a pending operation"]
    assert gpu_check.ended_the_group(gpu_check.abort_lines(log)[0])


def test_snapshots_that_turned_themselves_off_are_found_in_the_log() -> None:
    log = ("I1127 13:57:02.675000 1 x.py:1] step 3\n"
           "14:01:02 WARNING [rank0] elastic._worker.checkpoint.memory: in-memory snapshots are off from now on: "
           "cannot allocate the snapshot in /dev/shm/x (No space left on device); checkpoints go to disk only\n")
    assert gpu_check.snapshots_off(log).endswith("(No space left on device); checkpoints go to disk only")
    assert gpu_check.snapshots_off("step 3\n") is None


def test_checkpoints_compare_bit_for_bit() -> None:
    state = {"model/w": torch.tensor([1.0, -0.0, 2.5]), "optim/w/step": torch.tensor(3.0),
             "model/b": torch.zeros(0, dtype=torch.bfloat16)}
    same = {k: v.clone() for k, v in state.items()}
    assert gpu_check.compare_states(state, same) == {"identical": True, "tensors": 3, "differing": []}
    signed_zero = {**same, "model/w": torch.tensor([1.0, 0.0, 2.5])}  # equal as numbers, not as bits
    assert gpu_check.compare_states(state, signed_zero)["differing"] == ["model/w"]
    other_dtype = {**same, "optim/w/step": torch.tensor(3.0, dtype=torch.float64)}
    assert gpu_check.compare_states(state, other_dtype)["differing"] == ["optim/w/step"]
    missing = {k: v for k, v in same.items() if k != "model/b"}
    assert gpu_check.compare_states(state, missing) == {"identical": False, "tensors": 3, "differing": ["model/b"]}


def recorded_results() -> dict:
    return {
        "dry_run": False, "json": "runs/gpu-check.json",
        "device": {"name": "NVIDIA H100 80GB HBM3", "count": 1, "peak_bf16_tflops": 989.0, "peak_note": None},
        "parts": {
            "ddp-gpu": {"status": "ok", "world_size": 1, "steps_per_s": 5.125, "mfu": 0.4123, "parameters_m": 127.6,
                        "seconds": 41.0},
            "ddp-2": {"status": "failed", "reason": "exit 1: DistBackendError: Duplicate GPU detected", "seconds": 20.0},
            "fsdp-2": {"status": "skipped", "reason": "2 workers cannot run here (ddp-2: exit 1)"},
            "snapshot-copy": {"status": "ok", "pinned_gb_s": 24.61, "pageable_gb_s": 7.03, "snapshot_slot_gb_s": 6.5,
                              "megabytes": 1073.7},
            "kill": {"status": "ok", "kill_to_step_s": 1.234, "restore_source": "memory", "redone": 0},
            "exactness": {"status": "ok", "identical": True, "tensors": 113},
        },
    }


def test_the_summary_has_a_line_per_part_with_its_figures_or_its_reason() -> None:
    lines = gpu_check.summary_lines(recorded_results())
    assert lines == [
        "gpu check on NVIDIA H100 80GB HBM3 (CUDA); peak bf16 989 TFLOPS",
        "  ddp-gpu         ok       world 1, 5.12 steps/s, MFU 41.2%, 128M params",
        "  ddp-2           failed   exit 1: DistBackendError: Duplicate GPU detected",
        "  fsdp-2          skipped  2 workers cannot run here (ddp-2: exit 1)",
        "  snapshot-copy   ok       pinned 24.6 GB/s, pageable 7.0 GB/s, snapshot slot 6.5 GB/s",
        "  kill            ok       kill to step 1.23 s, restored from memory",
        "  exactness       ok       bit-identical: True, 113 tensors",
        "1 part(s) failed: ddp-2; every figure: runs/gpu-check.json",
    ]


def test_an_unknown_gpu_is_said_so_and_shows_no_mfu() -> None:
    results = recorded_results()
    results["device"] = {"name": "NVIDIA L4", "peak_bf16_tflops": None, "peak_note": "'NVIDIA L4' is not in the peak table: no MFU"}
    results["parts"]["ddp-gpu"]["mfu"] = None
    lines = gpu_check.summary_lines(results)
    assert lines[0] == "gpu check on NVIDIA L4 (CUDA); peak bf16 unknown: 'NVIDIA L4' is not in the peak table: no MFU"
    assert "MFU" not in lines[1] and "5.12 steps/s" in lines[1]


def test_the_snapshot_copy_on_cpu_measures_pageable_buffers_and_the_shared_memory_slot() -> None:
    figures = gpu_check.measure_copy("cpu", megabytes=1, repeats=1)
    assert figures["pinned_gb_s"] is None  # pinned memory needs CUDA
    assert figures["megabytes"] == pytest.approx(2**20 / 1e6)
    assert figures["pageable_gb_s"] > 0 and figures["snapshot_slot_gb_s"] > 0


def test_a_machine_without_the_package_installed_is_told_how_in_one_line(capsys, tmp_path, monkeypatch) -> None:
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None if name == "crc32c" else real(name))
    status = gpu_check.main(["--dry-run", "--workdir", str(tmp_path / "work")])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err == (
        "gpu_check.py: error: missing Python packages: crc32c (pip install -e . installs them)\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "said"), [
    (["--only", "ddp-gpu,bogus"], "--only takes parts among ddp-gpu, ddp-2,"),
    (["--budget", "-1"], "--budget"),
    (["--dry-run", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ([], "no CUDA device is visible; run with --dry-run"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(argv, said, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        status = gpu_check.main([*argv, "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "out.json")])
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1 and said in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_part_that_fails_skips_or_runs_out_of_budget_is_recorded_and_the_check_goes_on(tmp_path, capsys) -> None:
    import time

    check = gpu_check.Check(workdir=tmp_path, dry_run=False, cuda=True, gpus=1, corpus=tmp_path / "c.txt",
                            deadline=time.time() + 100)

    def broken(check, deadline):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    def skipping(check, deadline):
        raise gpu_check.PartSkipped("needs ddp-gpu's step rate, which is missing")

    def failing(check, deadline):
        raise gpu_check.PartFailed("exit 1: NCCL error")

    seen = []

    def fine(check, limit):
        seen.append(limit)
        return {"steps_per_s": 3.0}

    outcome = {name: gpu_check.run_part(check, gpu_check.Part(name, run, 30)) for name, run in
               [("broken", broken), ("skipping", skipping), ("failing", failing), ("fine", fine)]}
    assert outcome["broken"]["status"] == "failed"
    assert outcome["broken"]["reason"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert {k: outcome["skipping"][k] for k in ("status", "reason")} == {
        "status": "skipped", "reason": "needs ddp-gpu's step rate, which is missing"}
    assert {k: outcome["failing"][k] for k in ("status", "reason")} == {"status": "failed", "reason": "exit 1: NCCL error"}
    assert outcome["fine"]["status"] == "ok" and outcome["fine"]["steps_per_s"] == 3.0
    assert seen[0] <= time.time() + 30  # the part's own limit, not the whole budget
    check.deadline = time.time() + 5
    assert gpu_check.run_part(check, gpu_check.Part("late", fine, 30)) == {
        "status": "skipped", "reason": "the check's time budget ran out (--budget)"}
    check.cuda = False
    assert gpu_check.run_part(check, gpu_check.Part("gpu-only", fine, 30, needs_cuda=True)) == {
        "status": "skipped", "reason": "needs CUDA"}
    assert len(seen) == 1


class FakeJob:
    """A launcher job as gpu_check starts it, without processes: it checks the recipe takes the
    arguments it was given (a typo there would only show on a GPU), and writes what such a job
    writes: its log, its event log at 10 steps/s (8 with a snapshot every step), a final checkpoint,
    and a restarted group when a fault was asked for. Two workers fail as NCCL fails them on one GPU."""

    launched: ClassVar[list[FakeJob]] = []

    def __init__(self, directory, nproc, script_args, *, max_restarts=0, env=None) -> None:
        import gpt  # recipes/gpt.py

        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.nproc, self.env = directory, nproc, env or {}
        self.args = gpt.build_parser().parse_args(list(script_args))
        self.started = __import__("time").time()
        self.process = type("Process", (), {"pid": 4242, "returncode": 0, "poll": lambda self: None})()
        hold = next((part[len("until="):] for part in self.env.get("ELASTIC_FAULT", "").replace(",", ":").split(":")
                     if part.startswith("until=")), None)
        if hold:
            open(f"{hold}.held", "w").close()
        FakeJob.launched.append(self)

    def worker_pid(self, rank):
        return 4343

    def wait(self, deadline):
        import time

        world = 1 if self.nproc == "gpu" else int(self.nproc)
        if world == 2:
            log = ("E1127 13:57:02.675000 1 api.py:836] torch.distributed.DistBackendError: NCCL error: invalid usage "
                   "(Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0)\n")
            (self.directory / "launcher.log").write_text(log)
            return gpu_check.JobResult(1, [], log)
        a = self.args
        per_step = 0.125 if a.snapshot_every == 1 and a.ckpt_dir and "stall" in str(self.directory) else 0.1
        tokens = a.batch_size * a.block_size * world
        records = [{"event": "start", "step": 0, "world_size": world, "time": self.started, "tokens_per_step": tokens}]
        records += [{"event": "step", "step": s, "world_size": world, "time": self.started + s * per_step}
                    for s in range(1, a.max_steps + 1)]
        if "ELASTIC_FAULT" in self.env:  # the group after the fault, from step 40
            now = time.time()
            records = [r for r in records if r["step"] <= 40 and r["event"] == "step" or r["event"] == "start"]
            records += [{"event": "restore", "step": 40, "time": now + 0.5, "source": "memory", "redone": 0},
                        {"event": "start", "step": 40, "time": now + 0.5, "world_size": world}]
            records += [{"event": "step", "step": s, "world_size": world, "time": now + 0.5 + (s - 40) * 0.1}
                        for s in range(41, a.max_steps + 1)]
        if a.ckpt_dir:
            (gpu_check.Path(a.ckpt_dir) / f"step_{a.max_steps:08d}").mkdir(parents=True)
        (self.directory / "launcher.log").write_text("watchdog: no training step completed for 10 s\n")
        return gpu_check.JobResult(0, records, "watchdog: no training step completed for 10 s\n")


def test_on_one_gpu_every_part_launches_the_recipe_as_a_gpu_user_would(tmp_path, monkeypatch, capsys) -> None:
    """The whole check on a pretend H100, its jobs faked (FakeJob): each part's command line, the
    figures made from what its job wrote, and two workers failing on one GPU as NCCL fails them."""
    import elastic

    FakeJob.launched = []
    monkeypatch.setattr(gpu_check, "Job", FakeJob)
    monkeypatch.setattr(gpu_check, "describe_device", lambda: {
        "name": "NVIDIA H100 80GB HBM3", "count": 1, "peak_bf16_tflops": 989.0, "peak_note": None})
    killed = []
    monkeypatch.setattr(gpu_check.os, "kill", lambda pid, signum: killed.append((pid, signum)))

    def measure_in_a_process(command, **kwargs):
        assert command[2:4] == ["--measure-copy", command[3]]
        gpu_check.Path(command[3]).write_text(gpu_check.json.dumps(gpu_check.measure_copy("cpu", 1, 1)))
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(gpu_check.subprocess, "run", measure_in_a_process)
    monkeypatch.setattr(elastic, "read_checkpoint", lambda path: (None, {"model/w": torch.ones(3)}, {}))
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--json", str(out), "--workdir", str(tmp_path / "work")]) == 1  # ddp-2 failed
    parts = gpu_check.json.loads(out.read_text())["parts"]
    assert {name: part["status"] for name, part in parts.items()} == {
        "ddp-gpu": "ok", "ddp-2": "failed", "fsdp-gpu": "ok", "fsdp-2": "skipped", "snapshot-copy": "ok",
        "snapshot-stall": "ok", "kill": "ok", "exactness": "ok", "hang": "ok", "small-model": "ok"}
    assert "Duplicate GPU detected" in parts["ddp-2"]["reason"] and "ddp-2: exit 1" in parts["fsdp-2"]["reason"]
    launched = {job.directory.name: job for job in FakeJob.launched}
    assert sorted(launched) == ["ddp-2", "ddp-gpu", "exactness", "fsdp-gpu", "hang", "kill", "small-model", "snapshot-stall"]
    for name, job in launched.items():
        assert job.args.device == "cuda", name
        assert job.nproc == {"ddp-2": "2", "hang": "1"}.get(name, "gpu"), name
    assert launched["fsdp-gpu"].args.fsdp and not launched["ddp-gpu"].args.fsdp
    assert launched["ddp-gpu"].args.n_layer == 18 and launched["ddp-gpu"].args.ckpt_dir is None  # no checkpoints
    assert launched["kill"].args.deterministic and launched["exactness"].args.deterministic
    assert launched["kill"].env["ELASTIC_FAULT"].startswith("after_step@40:do=hold:until=")
    assert launched["hang"].env["ELASTIC_FAULT"].endswith("after_step@40:rank=0:do=hang")  # one worker: rank 0
    assert killed == [(4343, gpu_check.signal.SIGKILL)]
    # The figures: 10 steps/s over the timed steps, nanoGPT's MFU against the H100's 989 TFLOPS.
    ddp = parts["ddp-gpu"]
    _, per_token = gpu_check.flops_per_token(gpu_check.LARGE_MODEL)
    assert ddp["steps_per_s"] == pytest.approx(10.0) and ddp["tokens_per_step"] == 16 * 1024
    assert ddp["mfu"] == pytest.approx(per_token * 16 * 1024 * 10.0 / 989e12)
    assert parts["snapshot-stall"]["stall_per_snapshot_s"] == pytest.approx(0.125 - 0.1)
    assert parts["kill"]["restore_source"] == "memory" and parts["kill"]["kill_to_step_s"] > 0
    assert parts["exactness"]["identical"] is True and parts["exactness"]["checkpoint"] == "step_00000120"
    assert parts["hang"]["world_size"] == 1 and "no peer to abort" in parts["hang"]["peer_note"]
    assert parts["snapshot-copy"]["pageable_gb_s"] > 0
    summary = capsys.readouterr().out.splitlines()
    assert summary[-1] == f"1 part(s) failed: ddp-2; every figure: {out}"
