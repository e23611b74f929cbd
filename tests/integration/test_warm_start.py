"""`elastic._agent.launcher` starts workers warm (forked from a fork server that imported torch)
and a script must not be able to tell, except by the time it saves: what it sees,
how it ends and what runs at its end are those of `python -u script.py`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, wait_for, worker_env

from elastic._agent.launcher.launch import describe_exit
from elastic._agent.launcher.proctree import descendants, worker_rank

pytestmark = pytest.mark.slow

PROBE = """\
import sys
torch_was_loaded = "torch" in sys.modules  # before this script imported anything
import atexit, gc, json, multiprocessing, os
import numpy, torch
import probe_sibling  # beside this script: its folder must be first on sys.path
# argv[2]: how each rank ends, comma-separated by rank; a rank's may be slash-separated by round (restart)
out, modes = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "0").split(",")
rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rounds = modes[min(rank, len(modes) - 1)].split("/")
mode = rounds[min(restart, len(rounds) - 1)]
tag = f"{rank}-{restart}"
report = {
    "torch_was_loaded": torch_was_loaded, "name": __name__, "argv": sys.argv, "path0": sys.path[0],
    "comm": open("/proc/self/comm").read().strip(), "rank": rank, "world_size": int(os.environ["WORLD_SIZE"]),
    "sibling": probe_sibling.VALUE, "session_leader": os.getsid(0) == os.getpid(),
    "start_method_unset": multiprocessing.get_start_method(allow_none=True) is None,
    "frozen": gc.get_freeze_count(), "collectable": len(gc.get_objects()), "mode": mode,
    # What a process takes from its own start: thread pools sized from its environment, fresh seeds.
    "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"), "mkl": os.environ.get("MKL_NUM_THREADS"),
    "torch_seed": torch.initial_seed(), "numpy_key": int(numpy.random.get_state()[1][1]),  # [0] is 2**31 whatever the seed
}
with open(os.path.join(out, f"rank{tag}.json"), "w") as f:
    json.dump(report, f)
atexit.register(lambda: open(os.path.join(out, f"atexit{tag}"), "w").close())
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
"""


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


def launch(
    *args: str, env: dict[str, str] | None = None, nproc: int = 2, cwd: Path = REPO, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "elastic._agent.launcher", f"--nproc-per-node={nproc}", "--monitor-interval=0.2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or worker_env())


def report(out: Path, rank: int, restart: int = 0) -> dict:
    """What the probe of `rank` saw, in the round after `restart` restarts."""
    return json.loads((out / f"rank{rank}-{restart}.json").read_text())


def reports(out: Path, ranks: int) -> list[dict]:
    return [report(out, rank) for rank in range(ranks)]


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("torchrevive-run: warning:")]


def test_workers_start_warm_and_see_what_python_script_would_show(out: Path, probe: Path, tmp_path: Path) -> None:
    """One job for all of it: a relative script path (made absolute), no rendezvous flags (torchrun's
    static default becomes a local c10d job), and three workers that end without error each its own
    way: sys.exit(0), sys.exit(), and a script that picks its own multiprocessing start method.

    Beside it the same probe starts cold (TORCHREVIVE_PRELOAD empty: warm starts off), and each warm
    worker sized its thread pools from its environment as a cold one does: with no OMP_NUM_THREADS
    exported, torchrun gives each of several workers OMP_NUM_THREADS=1, which the fork server, started
    before torchrun sets it, must not miss (it did: 2 threads a worker warm, 1 cold). And each warm
    worker's random generators are its own, as a fresh interpreter's are."""
    env = worker_env(PYTHONPATH=str(REPO))
    env.pop("OMP_NUM_THREADS")  # the user chose no thread count: torchrun's default applies
    modes = "0,exit-none,spawn"
    done = launch("scripts/probe.py", str(out), modes, nproc=3, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    cold_out = tmp_path / "cold"
    cold_out.mkdir()
    cold = launch("--standalone", str(probe), str(cold_out), nproc=2, env={**env, "TORCHREVIVE_PRELOAD": ""})
    assert cold.returncode == 0, cold.stdout + cold.stderr
    colds = reports(cold_out, 2)
    assert not any(seen["torch_was_loaded"] for seen in colds), "TORCHREVIVE_PRELOAD empty: cold workers"
    warms = reports(out, 3)
    derived = ("threads", "interop_threads", "omp", "mkl")
    assert {tuple(seen[k] for k in derived) for seen in warms} == {tuple(seen[k] for k in derived) for seen in colds}
    assert warms[0]["threads"] == 1 and warms[0]["omp"] == "1", warms[0]
    for field in ("torch_seed", "numpy_key"):
        assert len({seen[field] for seen in warms}) == 3, f"{field}: each warm worker seeds its own, as a cold one"
    for rank, seen in enumerate(warms):
        assert seen["torch_was_loaded"], "the worker imported torch itself: not a warm start"
        assert seen["name"] == "__main__"
        assert seen["argv"] == [str(probe), str(out), modes], "the script path is made absolute"
        assert seen["path0"] == str(probe.parent)
        assert seen["sibling"] == 42
        assert seen["comm"] == f"python-rank{rank}"
        assert (seen["rank"], seen["world_size"]) == (rank, 3)
        assert seen["session_leader"], "a terminal's signals must reach the agent, not the workers"
        assert seen["start_method_unset"]
        assert (out / f"atexit{rank}-0").exists(), f"atexit handlers run at the end ({seen['mode']})"
        # The preload's objects are frozen in the fork server: a worker's full collection skips them.
        assert seen["frozen"] > 10 * seen["collectable"], (seen["frozen"], seen["collectable"])


@pytest.mark.parametrize(
    ("how", "extra_args", "env"),
    [
        ("explicit --start-method=spawn", ["--start-method=spawn"], {}),
        ("PYTHON_EXEC", [], {"PYTHON_EXEC": sys.executable}),
    ],
)
def test_warm_start_can_be_turned_off(out: Path, probe: Path, how: str, extra_args: list[str], env: dict) -> None:
    done = launch("--standalone", *extra_args, str(probe), str(out), env=worker_env(**env), nproc=1)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = report(out, 0)
    assert not seen["torch_was_loaded"], f"{how}: the worker was started warm"
    assert seen["path0"] == str(probe.parent) and seen["sibling"] == 42


def test_a_module_runs_as_python_dash_m_and_a_preload_module_that_fails_to_import_is_one_line(
    out: Path, probe: Path, tmp_path: Path
) -> None:
    """`-m probe`, with TORCHREVIVE_PRELOAD naming a module that raises at import. multiprocessing's fork
    server skips a module that raises ImportError and dies on any other error, taking every worker start
    with it; here it is one line, and the workers start warm."""
    preload = tmp_path / "preload"
    preload.mkdir()
    (preload / "broken_at_import.py").write_text("raise ValueError('no config file')\n")
    env = worker_env(PYTHONPATH=os.pathsep.join([str(preload), str(probe.parent), str(REPO)]),
                     TORCHREVIVE_PRELOAD="torch,broken_at_import")
    done = launch("--standalone", "-m", "probe", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    for seen in reports(out, 2):
        assert seen["torch_was_loaded"] and seen["name"] == "__main__"
        assert seen["argv"] == [str(probe), str(out)]
        assert seen["path0"] == str(REPO), "python -m puts the working directory first"
    assert len(warnings(done.stderr)) == 1, done.stderr
    assert "'broken_at_import' failed to import in the fork server (ValueError: no config file)" in warnings(done.stderr)[0]


def test_a_failing_worker_reports_how_it_failed_and_runs_its_atexit_handlers(out: Path, probe: Path) -> None:
    """One warm worker, restarted twice, fails three ways: sys.exit(3), an uncaught exception, an uncaught
    KeyboardInterrupt. torch's agent sees each end as it would `python script.py`'s (exit status 3,
    exit status 1, killed by SIGINT); the job's last line names the last one; atexit handlers ran every
    time (a checkpoint in flight is committed). (One failure per round: of workers failing together,
    torch's agent reports only the first it sees.)"""
    done = launch("--standalone", "--max-restarts=2", str(probe), str(out), "3/raise/interrupt", nproc=1)
    assert done.returncode == 1, done.stdout + done.stderr
    seen = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: 0 ", done.stderr)
    assert seen == ["3", "1", str(-signal.SIGINT)], done.stderr
    # What the job's last line says of such an exit:
    assert [describe_exit(int(code)) for code in seen] == ["exit status 3", "exit status 1", "killed by SIGINT"]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torchrevive-run: job failed: worker rank 0 killed by SIGINT"), last
    for restart in range(3):
        assert report(out, 0, restart)["torch_was_loaded"], f"round {restart}: a restarted worker starts warm too"
        assert (out / f"atexit0-{restart}").exists(), f"round {restart}: atexit handlers run after a failure too"


def test_a_preload_module_that_initialises_cuda_makes_the_workers_start_cold(
    out: Path, probe: Path, tmp_path: Path
) -> None:
    """Forked from a fork server with CUDA initialised, every worker would die with torch's
    "Cannot re-initialize CUDA in forked subprocess", which names no module. Instead the job
    runs with cold workers and one warning line names the module and what to do."""
    preload = tmp_path / "preload"
    preload.mkdir()
    # On this CPU-only machine, what torch.cuda.init() would leave behind.
    (preload / "cuda_at_import.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    env = worker_env(PYTHONPATH=f"{preload}{os.pathsep}{REPO}", TORCHREVIVE_PRELOAD="torch,cuda_at_import")
    done = launch("--standalone", str(probe), str(out), env=env, nproc=1)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = report(out, 0)
    assert not seen["torch_was_loaded"], "a worker was forked from the fork server that initialised CUDA"
    assert seen["path0"] == str(probe.parent) and seen["sibling"] == 42
    assert len(warnings(done.stderr)) == 1, done.stderr
    assert "TORCHREVIVE_PRELOAD module 'cuda_at_import' initialised CUDA in the fork server" in warnings(done.stderr)[0]
    assert "drop 'cuda_at_import' from TORCHREVIVE_PRELOAD or import it in the training script" in warnings(done.stderr)[0]


def test_workers_do_not_outlive_a_killed_agent(out: Path, probe: Path) -> None:
    """The agent dies by SIGKILL (OOM killer, node drain): its warm workers notice and exit."""
    command = [sys.executable, "-m", "elastic._agent.launcher", "--standalone", "--nproc-per-node=2", str(probe), str(out), "sleep"]
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
