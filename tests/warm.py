"""Warm processes for the tests: Python programs forked from a process that has imported torch.

Every `python recipes/gpt.py ...` or `python -m elastic.checkpoint ...` a test starts would import
torch first: 1.5 to 3 s of CPU each, most of what a short program costs. `run` and `start` take
the same command line and fork the program instead from a zygote (tests/zygote.py), one per test
process, started at the first use and ended with the test process:

    done = warm.run([sys.executable, "-m", "elastic.checkpoint", "inspect", ckpt], env=env, timeout=60)
    proc = warm.start([sys.executable, str(GPT_RECIPE), ...], stdout=log, stderr=subprocess.STDOUT)

The program runs as `python ARGV` would, with its own environment, working directory and standard
streams (tests/zygote.py says what exactly); `start` gives a `subprocess.Popen`-like handle (pid,
poll, wait, send_signal, kill). The agents of the tests' jobs start this way too (`popen`:
support.start_agents, elastic.chaos.job_spec.JobSpec.start_process): what an agent then starts,
its workers and its fork server, starts as in production. What only a fresh interpreter shows
(an agent's own start, its imports, a program under srun) needs a real one: those tests keep
`subprocess`.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
_ZYGOTE = Path(__file__).resolve().parent / "zygote.py"


class _Zygote:
    """The test process's zygote: requests go out one at a time; exit statuses come back on a reader thread."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(
            [sys.executable, str(_ZYGOTE), str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env, cwd=REPO,
        )
        theirs.close()
        self._conn = ours
        self._lock = threading.Lock()
        self._started: dict[int, WarmProcess] = {}
        self._ended: dict[int, int] = {}
        self._answers: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        ready = json.loads(self._conn.recv(1 << 16) or b"{}")
        if not ready.get("ready"):
            raise RuntimeError("the test zygote (tests/zygote.py) did not start; run it by hand to see why")
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            data = self._conn.recv(1 << 16)
            self._take(json.loads(data) if data else {"closed": True})
            if not data:
                return

    def _take(self, message: dict[str, Any]) -> None:
        """One message from the zygote, in the order it sent them: a fork's pid, a program's exit status,
        or the end of the connection.

        A pid is the kernel's, and the kernel hands a pid out again once its process is gone (pid_max is
        32,768 on many machines, and a suite's threads count against it too): a program that ended long
        ago may have had the pid a new fork gets. Its exit status must not be read as the new program's,
        so a fork's answer forgets it. The zygote sends a program's exit status only after its pid, so
        what `_ended` holds for a pid once its fork's answer was taken is that program's own."""
        with self._changed:
            if "returncode" in message:
                self._ended[message["pid"]] = message["returncode"]
            else:
                if "pid" in message:
                    self._ended.pop(message["pid"], None)
                self._answers.append(message)
            self._changed.notify_all()

    def fork(self, argv: list[str], env: Mapping[str, str], cwd: str, fds: tuple[int, int, int]) -> int:
        request = json.dumps({"argv": argv, "env": dict(env), "cwd": cwd}).encode()
        with self._lock:
            self._conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            with self._changed:
                while not self._answers:
                    self._changed.wait()
                answer = self._answers.pop(0)
        if "pid" not in answer:
            raise RuntimeError("the test zygote (tests/zygote.py) is gone")
        return int(answer["pid"])

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while pid not in self._ended:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if self._answers and self._answers[-1].get("closed"):
                    raise RuntimeError("the test zygote (tests/zygote.py) is gone")
                self._changed.wait(left)
            return self._ended[pid]


_zygote: _Zygote | None = None
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.process.poll() is not None:
            _zygote = _Zygote()
        return _zygote


class WarmProcess:
    """A program forked by the zygote: the parts of `subprocess.Popen` the tests use."""

    def __init__(self, args: list[str], pid: int, zygote: _Zygote) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.returncode(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the program and everything in its session (it leads one)."""
        if self.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _fd(target: int | IO[Any] | None, default: int) -> tuple[int, bool]:
    """A file descriptor for one standard stream, and whether it is ours to close."""
    if target is None:
        return os.dup(default), True
    if target == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDWR), True
    if isinstance(target, int):
        return os.dup(target), True
    return os.dup(target.fileno()), True


def start(
    args: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
    stdin: int | IO[Any] | None = subprocess.DEVNULL, stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
) -> WarmProcess:
    """Start `args` (`[sys.executable, script-or--m-or--c, ...]`) warm; `stderr=subprocess.STDOUT` joins them."""
    argv = [os.fspath(a) for a in args]
    if argv[0] != sys.executable:
        raise ValueError(f"a warm process runs this interpreter's programs, not {argv[0]!r}")
    fds: list[int] = []
    try:
        fds.append(_fd(stdin, 0)[0])
        fds.append(_fd(stdout, 1)[0])
        fds.append(os.dup(fds[1]) if stderr == subprocess.STDOUT else _fd(stderr, 2)[0])
        zygote = _the_zygote()
        pid = zygote.fork(argv[1:], os.environ if env is None else env, os.fspath(cwd or os.getcwd()), tuple(fds))
    finally:
        for fd in fds:
            os.close(fd)
    return WarmProcess(argv, pid, zygote)


def popen(args: Sequence[str | os.PathLike[str]], **kwargs: Any) -> WarmProcess | subprocess.Popen:
    """`start` for this interpreter's programs, `subprocess.Popen` for any other command (`ip netns exec ...`):
    what a job's harness starts its agents with (elastic.chaos.job_spec.JobSpec.start_process)."""
    if os.fspath(args[0]) != sys.executable:
        return subprocess.Popen(args, **kwargs)
    return start(args, **kwargs)


def run(
    args: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None, input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(args, capture_output=True, text=True, ...)`, warm: the program's output as text;
    at `timeout` its session is killed and `subprocess.TimeoutExpired` raised."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as given:
        if input is not None:
            given.write(input.encode())
            given.seek(0)
        proc = start(args, env=env, cwd=cwd, stdin=given if input is not None else subprocess.DEVNULL, stdout=out, stderr=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, code, out.read().decode(errors="replace"), err.read().decode(errors="replace"))
