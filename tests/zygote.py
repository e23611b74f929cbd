"""The server side of tests/warm.py: a process that has imported torch and forks programs on request.

Run as `python tests/zygote.py FD` with FD one end of a Unix socket pair of SOCK_SEQPACKET (the
other is the test process's). It imports what the tests' programs import (torch, torch._dynamo, the
runtime), freezes those objects out of the garbage collector, and then serves requests, one JSON
message each, with the program's stdin, stdout and stderr passed along (SCM_RIGHTS):

    {"argv": [...], "env": {...}, "cwd": "..."}   ->   {"pid": N}, later {"pid": N, "returncode": R}

Each program is a fork that runs as `python ARGV` would (`run`): its own environment, working
directory and standard streams, `sys.argv`, its script's folder (or, for `-m`, the working
directory) first on `sys.path`, `__name__ == "__main__"`, atexit handlers at the end, and the exit
status python gives (an uncaught exception: its traceback and 1; SIGINT by KeyboardInterrupt). It
leads a session of its own, so its whole process group can be signalled. This process is single-
threaded: a fork of it holds no lock another thread took. It exits, killing its programs, when the
test process closes its end of the socket.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import gc
import json
import logging
import multiprocessing
import multiprocessing.util
import os
import runpy
import select
import signal
import socket
import sys
import traceback

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "elastic._worker.run.run", "elastic.checkpoint", "elastic.chaos.samples")
_MAX_REQUEST = 1 << 20


def run(argv: list[str], env: dict[str, str], cwd: str) -> int:
    """In the forked child: become `python ARGV` in `cwd` with `env`; the exit status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in extra if p not in sys.path]
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
    multiprocessing.set_start_method(None, force=True)
    sys.modules.pop("__mp_main__", None)
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
    from elastic._shared.slurm.requeue import catch_early

    catch_early(os.environ)  # what `import elastic` does in a fresh process of a Slurm job
    # torch's elastic agent sets its loggers' level from LOGLEVEL when its modules are imported (here,
    # in the zygote): give them this program's, as a fresh import would.
    level = env.get("LOGLEVEL", "WARNING")
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger) and logger.level:
            logger.setLevel(level)
    if argv[:2] == ["-m", "elastic._agent.launcher"]:
        _seed_fork_server()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = cwd
            sys.modules.pop(argv[1], None)  # run as __main__ from its source, as `python -m` does (no runpy warning)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        atexit._run_exitfuncs()
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as exc:  # noqa: BLE001 - what python prints for an uncaught exception
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__, "<frozen runpy>"):
            tb = tb.tb_next  # python's own traceback starts at the program
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # as python does: the program's own hook sees it
        code = 1
    atexit._run_exitfuncs()
    _flush()
    return code


def _seed_fork_server() -> None:
    """For an agent (`-m elastic._agent.launcher`): fork now, while this process is a warm and single-threaded
    copy of the zygote, a child that waits to become the agent's multiprocessing fork server, and
    make the agent's one spawn of a fork server (`multiprocessing.util.spawnv_passfds`) hand its
    command and descriptors to that child instead of starting a fresh interpreter that imports
    torch again. The fork server is then the agent's child, as a spawned one would be (its workers
    are the agent's descendants, and multiprocessing waits for it), and its preload (the launcher's
    warm start: elastic._agent.launcher.warm_start) finds torch, torch._dynamo and the runtime imported."""
    agent_end, seed_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seed = os.fork()
    if seed == 0:
        agent_end.close()
        _become_fork_server(seed_end)
    seed_end.close()
    spawn = multiprocessing.util.spawnv_passfds

    def spawnv_passfds(path: str, args: list[str], passfds: list[int]) -> int:
        if agent_end.fileno() < 0 or "multiprocessing.forkserver import main" not in (args[-1] if args else ""):
            return spawn(path, args, passfds)  # the resource tracker, or a second fork server: started as usual
        request = {"cmd": args[-1], "fds": list(passfds), "env": dict(os.environ), "cwd": os.getcwd()}
        agent_end.sendmsg([json.dumps(request).encode()],
                          [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passfds))])
        agent_end.close()
        return seed

    multiprocessing.util.spawnv_passfds = spawnv_passfds


def _become_fork_server(conn: socket.socket) -> None:
    """In the seed: wait for the agent's command; run it with its descriptors at the numbers it names."""
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(_MAX_REQUEST, socket.CMSG_LEN(8 * fds.itemsize))
    if not data:
        os._exit(0)  # the agent left without needing a fork server
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    conn.close()
    request = json.loads(data)
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]  # out of the way of the numbers below
    for fd in fds:
        os.close(fd)
    for fd, number in zip(parked, request["fds"]):
        os.dup2(fd, number)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    code = 0
    try:
        exec(compile(request["cmd"], "<fork server>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - as a fork server that failed would: its traceback, status 1
        traceback.print_exc()
        code = 1
    _flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _send(conn: socket.socket, message: dict) -> None:
    conn.send(json.dumps(message).encode())


def serve(conn: socket.socket) -> None:
    children: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([conn, *children], [], [])
        for fd in readable:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(conn, {"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
                continue
            fds = array.array("i")
            data, ancillary, _, _ = conn.recvmsg(_MAX_REQUEST, socket.CMSG_LEN(3 * fds.itemsize))
            if not data:
                for pid in children.values():
                    _kill_session(pid)
                return
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                conn.close()
                for pidfd in children:
                    os.close(pidfd)
                os.setsid()
                for target, source in enumerate(fds):
                    os.dup2(source, target)
                for source in fds:
                    if source > 2:
                        os.close(source)
                code = 1
                try:
                    code = run(request["argv"], request["env"], request["cwd"])
                finally:
                    os._exit(code)
            for source in fds:
                os.close(source)
            children[os.pidfd_open(pid)] = pid
            _send(conn, {"pid": pid})


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def main() -> None:
    conn = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the test run's: it closes the socket
    for name in PRELOAD:
        __import__(name)
    gc.collect()
    gc.freeze()  # a program's full collections walk only what it made (elastic._agent.launcher.warm_start does the same)
    _send(conn, {"ready": True})
    serve(conn)


if __name__ == "__main__":
    main()
