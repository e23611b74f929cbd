"""SIGTERM to a forked child (a DataLoader worker, a multiprocessing 'fork' child) is not the trainer's preemption.

Each test runs a small trainer script in its own interpreter, so pytest's signal
handlers are untouched and a regression (the trainer exiting 143 on a signal
meant for a child) ends that script, not the test session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The trainer: installs the handler, forks children (os.fork from the main
# thread and from another thread, multiprocessing 'fork'), SIGTERMs only the
# children (one alone, then two at once, twice), reaps them and waits past the grace.
TRAINER = textwrap.dedent(
    """
    import json, multiprocessing, os, select, signal, sys, threading, time

    import torch

    from elastic._worker.control.preemption import PreemptionHandler
    from elastic._worker.runtime.context import WorkerContext
    from elastic._worker.runtime.worker_env import parse_launch_env

    mode, grace = sys.argv[1], float(sys.argv[2])
    launch = parse_launch_env({})
    ctx = WorkerContext(rank=launch.rank, local_rank=launch.local_rank, world_size=launch.world_size,
                        local_world_size=launch.local_world_size, restart_count=launch.restart_count,
                        run_id=launch.run_id, device=torch.device("cpu"), backend=None)
    handler = PreemptionHandler(ctx, grace=grace)
    report_r, report_w = os.pipe()


    def child(kind, linger):
        # Let go of the test's stdout/stderr pipes: an orphan must not keep them open.
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        wakeup_fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup_fd)  # only read it: put it back as it was
        report = {"kind": kind, "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
                  "wakeup_fd": wakeup_fd, "signalled": handler.signalled, "requested": handler.requested()}
        os.write(report_w, (json.dumps(report) + "\\n").encode())
        time.sleep(linger)


    def os_fork(kind, linger=60.0):
        pid = os.fork()
        if pid == 0:
            try:
                child(kind, linger)
            finally:
                os._exit(0)
        return pid


    def fork_from_thread(kind):
        pids = []
        thread = threading.Thread(target=lambda: pids.append(os_fork(kind)))
        thread.start()
        thread.join()
        return pids[0]


    def read_reports(count):
        lines, buffered, deadline = [], b"", time.monotonic() + 30
        while len(lines) < count and time.monotonic() < deadline:
            if select.select([report_r], [], [], 1.0)[0]:
                buffered += os.read(report_r, 4096)
                *done, buffered = buffered.split(b"\\n")
                lines += [json.loads(line) for line in done]
        return lines


    def reap(pid, deadline):
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "alive"


    def terminate_children():
        forked = [os_fork("os.fork"), os_fork("os.fork"), fork_from_thread("os.fork in a thread")]
        processes = [multiprocessing.get_context("fork").Process(target=child, args=("multiprocessing", 60.0))
                     for _ in range(2)]
        for process in processes:
            process.start()
        reports = read_reports(len(forked) + len(processes))
        pids = forked + [process.pid for process in processes]
        started = time.monotonic()
        # One SIGTERM each, so a child that swallows its first one is seen alive.
        os.kill(pids[0], signal.SIGTERM)  # alone
        time.sleep(0.2)
        for pair in (pids[1:3], pids[3:5]):  # two at once: two bytes in one read
            for pid in pair:
                os.kill(pid, signal.SIGTERM)
            time.sleep(0.2)
        deadline = time.monotonic() + 20
        exits = [reap(pid, deadline) for pid in forked]
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
                exits.append("alive")
            else:
                exits.append(process.exitcode)
        time.sleep(max(0.0, started + 3.0 - time.monotonic()))  # past a 1 s grace: a leaked byte ends us by now
        return {"reports": reports, "exits": exits, "signalled": handler.signalled, "requested": handler.requested()}


    result = terminate_children()
    print(json.dumps(result), flush=True)

    if mode == "self":  # our own SIGTERM still counts; a child forked afterwards is not signalled
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not handler.signalled and time.monotonic() < deadline:
            time.sleep(0.01)
        own = {"signalled": handler.signalled, "requested": handler.requested()}
        pid = os_fork("forked after the signal", linger=0.0)
        own["late_child"] = read_reports(1)
        own["late_child_exit"] = reap(pid, time.monotonic() + 30)
        print(json.dumps(own), flush=True)
    elif mode == "blocked":  # no step boundary will come: the watcher must end us after the grace
        print("blocked", flush=True)
        os.read(os.pipe()[0], 1)
    elif mode == "sleep":  # for the second SIGTERM
        print("sleeping", flush=True)
        while not handler.signalled:
            time.sleep(0.01)
        print("signalled", flush=True)
        time.sleep(60)
    """
)


def start(mode: str, grace: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-c", TRAINER, mode, str(grace)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Leave no trainer or child behind, whatever the outcome."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def children_result(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:  # the trainer died: show why
        proc.wait(timeout=30)
        raise AssertionError(f"trainer exited {proc.returncode} while only its children were signalled:\n"
                             f"{proc.stderr.read()}")
    result = json.loads(line)
    assert len(result["reports"]) == 5, result
    for report in result["reports"]:
        assert report["sigterm_default"], report  # the SIGTERM disposition from before the install
        assert report["wakeup_fd"] == -1, report  # not the socket the trainer's watcher reads
        assert not report["signalled"] and not report["requested"], report
    assert result["exits"] == [-signal.SIGTERM] * 5, result  # each child died of its own SIGTERM
    assert result["signalled"] is False and result["requested"] is False, result
    return result


def test_sigterm_to_forked_children_is_not_the_trainers_and_its_own_still_counts() -> None:
    proc = start("self", grace=1.0)
    try:
        children_result(proc)
        own = json.loads(proc.stdout.readline() or "null")
        assert own is not None, proc.stderr.read()
        assert own["signalled"] is True and own["requested"] is True, own
        # A child forked after the trainer's own signal does not inherit it.
        [late] = own["late_child"]
        assert late["sigterm_default"] and late["wakeup_fd"] == -1, late
        assert not late["signalled"] and not late["requested"], late
        assert own["late_child_exit"] == 0, own
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
    finally:
        kill_group(proc)


def test_trainer_still_exits_143_after_the_grace_once_its_children_were_signalled() -> None:
    proc = start("blocked", grace=1.0)
    try:
        children_result(proc)
        assert proc.stdout.readline().strip() == "blocked"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 143, stderr
        assert "no step ended within 1 s" in stderr
    finally:
        kill_group(proc)


def test_second_sigterm_to_the_trainer_still_kills_at_once() -> None:
    # A grace far longer than the timeout below: only the second signal can end the trainer in time.
    proc = start("sleep", grace=120.0)
    try:
        children_result(proc)
        assert proc.stdout.readline().strip() == "sleeping"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "signalled"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert proc.returncode in (143, -signal.SIGTERM)
    finally:
        kill_group(proc)
