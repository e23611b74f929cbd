"""The tests' one-machine Slurm (the benchmarks start it too): munged, slurmctld and two slurmd
daemons (nodes n1 and n2 on this host, Slurm's multiple-slurmd mode), each with its own
directories and ports under a folder, started from Debian's packages (the README's test
command installs them the way it installs etcd).

`SlurmCluster.start()` raises `SlurmUnavailable` (one line: the tests skip with it) where the
programs are missing or the daemons cannot run (slurmd launches tasks as their user: root).
"""

from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

from elastic.chaos.netns import free_port

TORCHRUN_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "sinfo")
NODES = ("n1", "n2")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says why."""


class SlurmCluster:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.conf = base / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []
        self._munged_pid: int | None = None
        # Job ids, hence the jobs' default ports (elastic._shared.slurm.step), apart from another cluster's.
        self.first_job_id = random.randrange(1, 4000)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for the Slurm commands (and what sbatch and srun pass to the job): a user's
        shell, without torchrun's variables (another test may have left them in this process)."""
        clean = {k: v for k, v in os.environ.items()
                 if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
        return {**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SLURM_CONF": str(self.conf), **extra}

    def run(self, argv: list[str], timeout: float = 60, check: bool = True, **extra_env: str) -> str:
        """A Slurm command's stdout (`RuntimeError` with its stderr when it fails and `check`)."""
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env(**extra_env))
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def start(self) -> SlurmCluster:
        missing = [name for name in PROGRAMS if shutil.which(name) is None]
        if missing:
            raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} missing): the README's test "
                                   "command installs munge, slurmctld, slurmd and slurm-client")
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root to start tasks, and these tests do not")
        for sub in ("munge", "ctld", "log", *(f"spool-{node}" for node in NODES)):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        (self.base / "munge").chmod(0o700)
        key = self.base / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = self.base / "munge" / "socket"
        subprocess.run(
            ["munged", "--force", f"--socket={socket_path}", f"--key-file={key}",
             f"--pid-file={self.base / 'munge' / 'pid'}", f"--seed-file={self.base / 'munge' / 'seed'}",
             f"--log-file={self.base / 'log' / 'munged.log'}"],
            check=True, capture_output=True, timeout=30,
        )
        self._munged_pid = int((self.base / "munge" / "pid").read_text())
        self.conf.write_text(self._config(socket_path))
        logs = self.base / "log"
        self._daemons.append(subprocess.Popen(["slurmctld", "-D", "-f", str(self.conf)], env=self.env(),
                                              stdout=subprocess.DEVNULL, stderr=(logs / "ctld.err").open("w")))
        for node in NODES:
            self._daemons.append(subprocess.Popen(["slurmd", "-D", "-f", str(self.conf), "-N", node], env=self.env(),
                                                  stdout=subprocess.DEVNULL, stderr=(logs / f"{node}.err").open("w")))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10).split()
            if states.count("idle") == len(NODES):
                return self
            if any(proc.poll() is not None for proc in self._daemons):
                break
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"the one-machine Slurm did not come up: {self.log_tail()}")

    def _config(self, munge_socket: Path) -> str:
        base, ports = self.base, {node: free_port() for node in NODES}
        nodes = "\n".join(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[node]} CPUs=4 RealMemory=2000"
            for node in NODES
        )
        return f"""\
ClusterName=torchrevive{self.first_job_id}
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={base}/ctld
SlurmdSpoolDir={base}/spool-%n
SlurmctldPidFile={base}/ctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/log/ctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=0
FirstJobId={self.first_job_id}
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted((self.base / "log").glob("*")):
            text = path.read_text(errors="replace").strip().splitlines()[-lines:]
            out.append(f"== {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def state(self) -> str:
        """What a failed wait should show: the queue, the nodes' states and the daemons' logs."""
        queue = self.run(["squeue", "-o", "%i %j %T %R"], check=False)
        nodes = self.run(["sinfo", "-N", "-o", "%N %T %E"], check=False)
        return f"squeue:\n{queue}\nsinfo:\n{nodes}\n{self.log_tail()}"

    def wait_idle(self, timeout: float = 90) -> None:
        """Until no job is queued and every node is idle (a node an earlier test left down or drained is
        resumed): a test's srun or sbatch must not queue behind an earlier test's job that is still
        completing (KillWait) or a node that stopped answering under load. `AssertionError` with the
        cluster's state past `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            queued = self.run(["squeue", "-h", "-o", "%i"], check=False).split()
            states = dict(line.split()[:2] for line in self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
                          .splitlines() if len(line.split()) >= 2)
            stuck = [node for node, state in states.items() if state.rstrip("*~#").startswith(("down", "drain"))]
            if stuck and not queued:
                self.run(["scontrol", "update", f"NodeName={','.join(stuck)}", "State=RESUME"], check=False)
            if not queued and states and all(state.rstrip("*~#") == "idle" for state in states.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the Slurm cluster was not idle within {timeout:g} s\n{self.state()}")
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self._daemons:
            proc.terminate()
        for proc in self._daemons:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._daemons = []
        if self._munged_pid is not None:
            _end_daemon(self._munged_pid)
            self._munged_pid = None

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _end_daemon(pid: int, grace: float = 10.0) -> None:
    """SIGTERM a daemon that is not our child (munged forks into the background) and wait until it is
    gone: it removes its socket and pid file as it exits, so its folder can be removed only after.
    SIGKILL after `grace` seconds."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        os.kill(pid, signal.SIGTERM)
        if not select.select([handle], [], [], grace)[0]:  # a pidfd is readable once its process has exited
            os.kill(pid, signal.SIGKILL)
            select.select([handle], [], [], grace)
    except ProcessLookupError:
        pass
    finally:
        os.close(handle)
