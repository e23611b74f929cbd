"""The Slurm requeue signal in a worker (elastic._worker.control.preemption): it stops the job like SIGTERM and marks
it for requeueing; it never kills at once (Slurm may send it twice), SIGTERMs after it (the agent
stopping its workers, slurmstepd's own within 2 s) change nothing, a SIGTERM after that window ends
the process; children forked after the install ignore it (Slurm signals every process of a step,
data loader workers too); one that arrives before the handler is installed is acted on. Outside a
Slurm job USR1 keeps its default action.

The handler runs in a script of its own, so pytest's signal handlers are untouched; the script forks
the process outside a job before anything imports elastic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from support import REPO

SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch

    def preempt():
        from elastic._worker.control.preemption import PreemptionHandler
        from elastic._worker.runtime.context import WorkerContext
        from elastic._shared.slurm.requeue import preemption_settings

        ctx = WorkerContext(rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0, run_id="t",
                            device=torch.device("cpu"), backend=None)
        import elastic  # from here on the requeue signal is remembered until the handler takes it over
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        handler = PreemptionHandler(ctx, grace=60, **preemption_settings(os.environ))
        report = {"early": handler.signalled and handler.requeue_signalled}
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # again: Slurm's --signal and the batch shell's scancel
        os.kill(os.getpid(), signal.SIGTERM)  # the agent stopping its workers
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)  # slurmstepd's own, within the window: the same one twice
        time.sleep(0.3)
        report["alive"] = True
        report["signalled"], report["requeue"] = handler.signalled, handler.requeue_signalled
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.write(write, str(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN).encode())
            os._exit(0)
        os.waitpid(child, 0)
        report["child_ignores"] = os.read(read, 16).decode() == "True"
        return report

    # Outside a Slurm job (a child without Slurm's variables, elastic not imported yet): the first USR1
    # kills it; whatever it prints goes back through a pipe.
    read, write = os.pipe()
    outside = os.fork()
    if outside == 0:
        os.close(read)
        os.dup2(write, 1)
        for name in [name for name in os.environ if name.startswith("SLURM_")]:
            del os.environ[name]
        print(json.dumps(preempt()), flush=True)
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(outside, 0)
    with os.fdopen(read) as pipe:
        printed = pipe.read()
    report = {"outside": [os.WTERMSIG(status) if os.WIFSIGNALED(status) else None, printed]}

    report.update(preempt())
    print(json.dumps(report), flush=True)
    time.sleep(2.0)  # past the window since the first SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: the default action, now
    time.sleep(5)
    print("still alive", flush=True)
""")


def test_the_requeue_signal_stops_once_never_kills_and_a_second_sigterm_does_and_outside_a_job_it_kills() -> None:
    env = {**os.environ, "SLURM_JOB_ID": "42", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    lines = done.stdout.strip().splitlines()
    # The handler (killed by SIGTERM) or the watcher thread (exit 143), whichever acts first.
    assert done.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), (done.returncode, done.stdout, done.stderr)
    assert lines and json.loads(lines[0]) == {
        "outside": [signal.SIGUSR1, ""],  # outside a job USR1 keeps its default action: killed, nothing printed
        "early": True, "alive": True, "signalled": True, "requeue": True, "child_ignores": True,
    }, (done.stdout, done.stderr)
    assert "still alive" not in done.stdout
    assert done.stderr.count("received SIGUSR1: finishing this step") == 1, done.stderr
