"""`elastic.launcher` starts workers warm (forked from a fork server that imported torch)
and a script must not be able to tell, except by the time it saves: what it sees,
how it ends and what runs at its end are those of `python -u script.py`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, wait_for, worker_env

from elastic.launcher.proctree import descendants, worker_rank

pytestmark = pytest.mark.slow

PROBE = '''\
import sys
torch_was_loaded = "torch" in sys.modules  # before this script imported anything
import atexit, gc, json, multiprocessing, os
import probe_sibling  # beside this script: its folder must be first on sys.path
out, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "0"
rank = os.environ["RANK"]
report = {
    "torch_was_loaded": torch_was_loaded, "name": __name__, "argv": sys.argv, "path0": sys.path[0],
    "comm": open("/proc/self/comm").read().strip(), "rank": int(rank), "world_size": int(os.environ["WORLD_SIZE"]),
    "sibling": probe_sibling.VALUE, "session_leader": os.getsid(0) == os.getpid(),
    "start_method_unset": multiprocessing.get_start_method(allow_none=True) is None,
    "frozen": gc.get_freeze_count(), "collectable": len(gc.get_objects()),
}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
atexit.register(lambda: open(os.path.join(out, f"atexit{rank}"), "w").close())
print(f"rank {rank} reported", flush=True)
if mode == "sleep":
    import time
    time.sleep(600)
elif mode == "spawn":
    multiprocessing.set_start_method("spawn")
elif mode == "exit-none":
    sys.exit()
elif mode == "raise":
    raise RuntimeError("the script failed")
elif mode == "interrupt":
    raise KeyboardInterrupt
else:
    sys.exit(int(mode))
'''


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "probe_sibling.py").write_text("VALUE = 42\n")
    script = folder / "probe.py"
    script.write_text(PROBE)
    return script


@pytest.fixture
def out(tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


def launch(*args: str, env: dict[str, str] | None = None, nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "elastic.launcher", f"--nproc-per-node={nproc}", "--monitor-interval=0.2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env or worker_env())


def reports(directory: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(ranks)]


def test_workers_start_warm_and_see_what_python_script_would_show(out: Path, probe: Path) -> None:
    done = launch("--standalone", str(probe), str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank, report in enumerate(reports(out)):
        assert report["torch_was_loaded"], "the worker imported torch itself: not a warm start"
        assert report["name"] == "__main__"
        assert report["argv"] == [str(probe), str(out)]
        assert report["path0"] == str(probe.parent)
        assert report["sibling"] == 42
        assert report["comm"] == f"python-rank{rank}"
        assert (report["rank"], report["world_size"]) == (rank, 2)
        assert report["session_leader"], "a terminal's signals must reach the agent, not the workers"
        assert report["start_method_unset"]
        assert (out / f"atexit{rank}").exists(), "atexit handlers run at the end"
        # The preload's objects are frozen in the fork server: a worker's full collection skips them.
        assert report["frozen"] > 10 * report["collectable"], (report["frozen"], report["collectable"])


def test_a_one_node_job_without_rendezvous_flags_runs_as_under_torchrun(out: Path, probe: Path) -> None:
    """torchrun's static default (no --standalone, no endpoint) becomes a local c10d job."""
    done = launch(str(probe), str(out), nproc=1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert reports(out, 1)[0]["torch_was_loaded"]


def test_relative_script_path_is_made_absolute(out: Path, probe: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "elastic.launcher", "--standalone", "--nproc-per-node=2", "scripts/probe.py", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=worker_env(PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert reports(out)[0]["argv"][0] == str(probe)


@pytest.mark.parametrize(
    ("how", "extra_args", "env"),
    [
        ("empty TORCHREVIVE_PRELOAD", [], {"TORCHREVIVE_PRELOAD": ""}),
        ("explicit --start-method=spawn", ["--start-method=spawn"], {}),
        ("PYTHON_EXEC", [], {"PYTHON_EXEC": sys.executable}),
    ],
)
def test_warm_start_can_be_turned_off(out: Path, probe: Path, how: str, extra_args: list[str], env: dict) -> None:
    done = launch("--standalone", *extra_args, str(probe), str(out), env=worker_env(**env))
    assert done.returncode == 0, done.stdout + done.stderr
    for report in reports(out):
        assert not report["torch_was_loaded"], f"{how}: the worker was started warm"
        assert report["path0"] == str(probe.parent) and report["sibling"] == 42


def test_a_module_runs_as_python_dash_m(out: Path, probe: Path) -> None:
    done = launch("--standalone", "-m", "probe", str(out), env=worker_env(PYTHONPATH=f"{probe.parent}{os.pathsep}{REPO}"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = reports(out)[0]
    assert report["torch_was_loaded"] and report["name"] == "__main__"
    assert report["argv"] == [str(probe), str(out)]
    assert report["path0"] == str(REPO), "python -m puts the working directory first"


@pytest.mark.parametrize("mode", ["exit-none", "spawn"])
def test_scripts_that_end_without_error_succeed(out: Path, probe: Path, mode: str) -> None:
    """sys.exit() and a script that picks its own multiprocessing start method end the job with 0."""
    done = launch("--standalone", str(probe), str(out), mode, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    ("mode", "summary"),
    [("3", "exit status 3"), ("raise", "exit status 1"), ("interrupt", "killed by SIGINT")],
)
def test_a_failing_worker_reports_how_it_failed_and_runs_its_atexit_handlers(
    out: Path, probe: Path, mode: str, summary: str
) -> None:
    done = launch("--standalone", "--max-restarts=0", str(probe), str(out), mode, timeout=90)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torchrevive-run: job failed: worker rank") and summary in last, last
    assert any(out.glob("atexit*")), "atexit handlers run after a failure too (a checkpoint in flight is committed)"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["no/such/script.py"], {}, "training script no/such/script.py does not exist"),
        (["probe.py"], {"TORCHREVIVE_PRELOAD": "torch,no_such_module_xyz"}, "'no_such_module_xyz'"),
        # Before torch's agent logs its options: the password reaches no log.
        (["--rdzv-conf=user=root,password=hunter2secret", "probe.py"], {}, "give password_file=PATH instead"),
    ],
)
def test_bad_script_or_preload_is_one_line_exit_2(tmp_path: Path, args: list[str], env: dict, message: str) -> None:
    (tmp_path / "probe.py").write_text("")
    command = [sys.executable, "-m", "elastic.launcher", "--standalone", "--nproc-per-node=1", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=worker_env(PYTHONPATH=str(REPO), **env))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert message in done.stderr and "hunter2secret" not in done.stderr + done.stdout


def launch_with_preload(tmp_path: Path, probe: Path, out: Path, module: str, source: str) -> subprocess.CompletedProcess[str]:
    """The probe job with `TORCHREVIVE_PRELOAD=torch,<module>`, `module` written from `source`."""
    preload = tmp_path / "preload"
    preload.mkdir()
    (preload / f"{module}.py").write_text(source)
    env = worker_env(PYTHONPATH=f"{preload}{os.pathsep}{REPO}", TORCHREVIVE_PRELOAD=f"torch,{module}")
    return launch("--standalone", str(probe), str(out), env=env)


def test_a_preload_module_that_initialises_cuda_makes_the_workers_start_cold(
    out: Path, probe: Path, tmp_path: Path
) -> None:
    """Forked from a fork server with CUDA initialised, every worker would die with torch's
    "Cannot re-initialize CUDA in forked subprocess", which names no module. Instead the job
    runs with cold workers and one warning line names the module and what to do."""
    # On this CPU-only machine, what torch.cuda.init() would leave behind.
    done = launch_with_preload(tmp_path, probe, out, "cuda_at_import", "import torch\ntorch.cuda.is_initialized = lambda: True\n")
    assert done.returncode == 0, done.stdout + done.stderr
    for report in reports(out):
        assert not report["torch_was_loaded"], "a worker was forked from the fork server that initialised CUDA"
        assert report["path0"] == str(probe.parent) and report["sibling"] == 42
    warnings = [line for line in done.stderr.splitlines() if line.startswith("torchrevive-run: warning:")]
    assert len(warnings) == 1, done.stderr
    assert "TORCHREVIVE_PRELOAD module 'cuda_at_import' initialised CUDA in the fork server" in warnings[0]
    assert "drop 'cuda_at_import' from TORCHREVIVE_PRELOAD or import it in the training script" in warnings[0]


def test_a_preload_module_that_fails_to_import_is_one_line_and_the_rest_stay_warm(
    out: Path, probe: Path, tmp_path: Path
) -> None:
    """multiprocessing's fork server skips a module that raises ImportError and dies on any
    other error, taking every worker start with it; here it is one line, and workers start warm."""
    done = launch_with_preload(tmp_path, probe, out, "broken_at_import", "raise ValueError('no config file')\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(report["torch_was_loaded"] for report in reports(out))
    warnings = [line for line in done.stderr.splitlines() if line.startswith("torchrevive-run: warning:")]
    assert len(warnings) == 1, done.stderr
    assert "'broken_at_import' failed to import in the fork server (ValueError: no config file)" in warnings[0]


def test_workers_do_not_outlive_a_killed_agent(out: Path, probe: Path) -> None:
    """The agent dies by SIGKILL (OOM killer, node drain): its warm workers notice and exit."""
    command = [sys.executable, "-m", "elastic.launcher", "--standalone", "--nproc-per-node=2", str(probe), str(out), "sleep"]
    agent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=worker_env())
    tree: list[int] = []
    try:
        wait_for(lambda: len(list(out.glob("rank*.json"))) == 2, 90, "both workers to report")
        tree = descendants(agent.pid)  # fork server, resource tracker, workers
        workers = [pid for pid in tree if worker_rank(pid) is not None]
        assert len(workers) == 2
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        wait_for(lambda: not any(_alive(pid) for pid in workers), 30, "the workers to exit after their agent")
        wait_for(lambda: not any(_alive(pid) for pid in tree), 30, "the fork server to exit after its workers")
    finally:
        for pid in [agent.pid, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"
