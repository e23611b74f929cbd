"""`elastic.launch` starts workers warm (forked from a fork server that imported torch)
and they must not be able to tell, except by the time they save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, wait_for, worker_env

from elastic.chaos.harness import rank_of
from elastic.proctree import descendants

pytestmark = pytest.mark.slow

PROBE = '''\
import sys
torch_was_loaded = "torch" in sys.modules  # before this script imported anything
import json, os
import probe_sibling  # beside this script: its folder must be first on sys.path
report = {
    "torch_was_loaded": torch_was_loaded, "name": __name__, "argv": sys.argv, "path0": sys.path[0],
    "comm": open("/proc/self/comm").read().strip(), "rank": int(os.environ["RANK"]),
    "world_size": int(os.environ["WORLD_SIZE"]), "sibling": probe_sibling.VALUE,
}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as out:
    json.dump(report, out)
print(f"rank {os.environ['RANK']} reported", flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "sleep":
    import time
    time.sleep(600)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
'''


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "probe_sibling.py").write_text("VALUE = 42\n")
    script = folder / "probe.py"
    script.write_text(PROBE)
    return script


def launch(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "elastic.launch", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
               *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env or worker_env())


def reports(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(2)]


def test_workers_start_warm_and_see_what_python_script_would_show(tmp_path: Path, probe: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = launch(str(probe), str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    for rank, report in enumerate(reports(out)):
        assert report["torch_was_loaded"], "the worker imported torch itself: not a warm start"
        assert report["name"] == "__main__"
        assert report["argv"] == [str(probe), str(out)]
        assert report["path0"] == str(probe.parent)
        assert report["sibling"] == 42
        assert report["comm"] == f"python-rank{rank}"
        assert (report["rank"], report["world_size"]) == (rank, 2)


def test_relative_script_path_is_made_absolute(tmp_path: Path, probe: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "elastic.launch", "--standalone", "--nproc-per-node=2", "scripts/probe.py", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=worker_env(PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert reports(out)[0]["argv"][0] == str(probe)


@pytest.mark.parametrize(
    ("how", "extra_args", "env"),
    [
        ("empty TORCHREVIVE_PRELOAD", [], {"TORCHREVIVE_PRELOAD": ""}),
        ("explicit --start-method=spawn", ["--start-method=spawn"], {}),
    ],
)
def test_warm_start_can_be_turned_off(tmp_path: Path, probe: Path, how: str, extra_args: list[str], env: dict) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = launch(*extra_args, str(probe), str(out), env=worker_env(**env))
    assert done.returncode == 0, done.stdout + done.stderr
    for report in reports(out):
        assert not report["torch_was_loaded"], f"{how}: the worker was started warm"
        assert report["path0"] == str(probe.parent) and report["sibling"] == 42


def test_a_module_runs_as_python_dash_m(tmp_path: Path, probe: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = launch("-m", "probe", str(out), env=worker_env(PYTHONPATH=f"{probe.parent}{os.pathsep}{REPO}"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = reports(out)[0]
    assert report["torch_was_loaded"] and report["name"] == "__main__"
    assert report["argv"] == [str(probe), str(out)]


def test_a_failing_worker_reports_its_exit_status(tmp_path: Path, probe: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    done = launch("--max-restarts=0", str(probe), str(out), "3")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torchrevive-run: job failed: worker rank") and "exit status 3" in last, last


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["no/such/script.py"], {}, "training script no/such/script.py does not exist"),
        (["probe.py"], {"TORCHREVIVE_PRELOAD": "torch,no_such_module_xyz"}, "'no_such_module_xyz'"),
    ],
)
def test_bad_script_or_preload_is_one_line_exit_2(tmp_path: Path, args: list[str], env: dict, message: str) -> None:
    (tmp_path / "probe.py").write_text("")
    command = [sys.executable, "-m", "elastic.launch", "--standalone", "--nproc-per-node=1", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=worker_env(PYTHONPATH=str(REPO), **env))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert message in done.stderr


def test_workers_do_not_outlive_a_killed_agent(tmp_path: Path, probe: Path) -> None:
    """The agent dies by SIGKILL (OOM killer, node drain): its warm workers notice and exit."""
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "elastic.launch", "--standalone", "--nproc-per-node=2", str(probe), str(out), "sleep"]
    agent = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=worker_env())
    tree: list[int] = []
    try:
        wait_for(lambda: len(list(out.iterdir())) == 2, 90, "both workers to report")
        tree = descendants(agent.pid)  # fork server, resource tracker, workers
        workers = [pid for pid in tree if rank_of(pid) is not None]
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
