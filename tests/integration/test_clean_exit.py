"""Clean exits: the shortest real job (GPT recipe, tiny, 2 workers, gloo on CPU) never ends its
workers with SIGABRT ("terminate called without an active exception", exit -6).

That abort (elastic/_shared/common/threads.py says why) takes two things: a Python thread still alive when the
interpreter starts finalizing, and that thread waking inside a torch C++ call before the process is
gone. The second is a race of the scheduler's: it hit 1 run in 4 under load when the checkpoint
heartbeat outlived the run, and a test that waits for it (many runs beside a CPU burner) catches a
regression only by chance. The first is certain and can be seen: each worker here runs the recipe
under a wrapper whose atexit handler, registered before anything else and so run after every other
one (the library's own `elastic._shared.common.threads` hook included), right before finalization, writes down
which threads are alive then. There must be none, in every worker, on every run. It must also have
seen the library's threads start, or the test would prove nothing. (With that bug put back, a
heartbeat that neither the claim's stop nor any atexit hook ends, this test failed on every run,
naming checkpoint-heartbeat; the 10 runs in pairs beside a CPU burner that it replaces saw no abort.)

`python benchmarks/exit_stress.py` still runs the job many times under load, for aborts of any other
cause (a C++ destructor's, say), which no single run can show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from support import REPO, free_port

sys.path.insert(0, str(REPO / "benchmarks"))

import exit_stress  # noqa: E402

WRAPPER = '''\
"""python -u WRAPPER SCRIPT ARGS: run SCRIPT as `python -u SCRIPT ARGS` would, noting the threads it starts
and, once every atexit handler but this one has run, the threads still alive."""
import atexit, json, os, runpy, sys, threading

started = []
_start = threading.Thread.start


def noting_start(self):
    started.append(self.name)
    return _start(self)


def note_threads_at_finalization():
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    with open(os.path.join(os.environ["EXIT_REPORT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"started": started, "alive": alive}, f)


threading.Thread.start = noting_start
atexit.register(note_threads_at_finalization)  # the first registered runs last
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)
runpy.run_path(script, run_name="__main__")
'''

# Started in every worker of this job, or on rank 0 only (the claim on the checkpoint directory).
EVERY_RANK = {"elastic-watchdog", "elastic-sigterm-grace", "checkpoint-writer"}
RANK_0 = {"checkpoint-heartbeat"}


@pytest.mark.slow
def test_the_shortest_job_leaves_no_thread_alive_for_the_interpreter_to_finalize(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "corpus.txt").write_text(exit_stress.CORPUS * 200)
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    command = exit_stress.job_command(workdir, steps=4)
    recipe = command.index(str(exit_stress.GPT_RECIPE))
    command.insert(recipe, str(wrapper))  # python -u wrapper.py gpt.py ARGS
    env = {**exit_stress.job_env(), "EXIT_REPORT_DIR": str(tmp_path)}
    done = warm.run(command, timeout=240, env=env, cwd=REPO)
    output = done.stdout + done.stderr
    assert not exit_stress.ABORT.search(output), f"a worker aborted at exit:\n{output[-4000:]}"
    assert done.returncode == 0, output[-4000:]
    for rank in (0, 1):
        report_file = tmp_path / f"rank{rank}.json"
        assert report_file.exists(), f"rank {rank} never reached its last atexit handler:\n{output[-4000:]}"
        report = json.loads(report_file.read_text())
        expected = EVERY_RANK | (RANK_0 if rank == 0 else set())
        assert expected <= set(report["started"]), (rank, report["started"])
        assert report["alive"] == [], f"rank {rank}: threads alive as the interpreter finalizes: {report['alive']}"


GROUP_LEFT = '''\
import gc, json, os, sys
import torch
from elastic._worker.runtime.context import worker_context  # the only import of the runtime: nothing else imported first

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
with worker_context("cpu"):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))  # imports torch.distributed.nn
    model(torch.ones(1, 2)).sum().backward()
    del model
gc.collect()
print(json.dumps({"before": before, "after": threads()}))
'''


def test_a_left_group_takes_its_threads_with_it_in_a_fresh_process(tmp_path: Path) -> None:
    """A worker that made its group through the runtime and built DDP: once it has left the group,
    none of gloo's threads is left (one left alive can wake while the interpreter finalizes and abort
    the process: the benchmarks' control_cost.py workers did, 2 runs in 20). A fresh interpreter:
    what the runtime imports before the group is made is the point."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", GROUP_LEFT], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["after"] == counts["before"], f"threads left behind by the group: {counts}"
