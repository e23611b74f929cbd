"""The job's secret: which one signs the rendezvous, the stores and the snapshot traffic, and when a
job may go without one.

One decision for every part of a job, under either launcher (torchrevive-run at its start, plain
torchrun in the `c10d-sealed` and `etcd-v3` handler creators), in this order:

1. `TORCHREVIVE_SNAPSHOT_SECRET_FILE`: the file given to every agent (a Kubernetes Secret, the Slurm
   script's, one of your own);
2. `TORCHREVIVE_SNAPSHOT_SECRET`: the secret itself, written to a 0600 file in this user's 0700
   directory (`secret_files.given_secret_file`) and removed from the environment;
3. a job on one host (its rendezvous endpoint a loopback address, or at most one node): a secret this
   host makes for the run (`secret_files.host_secret_file`), which every agent of the run here shares;
4. `TORCHREVIVE_UNSIGNED=1` (torchrevive-run's `--unsigned`): none, with one warning line;
5. otherwise `SecretError`: one line that says how to give one.

Invariants: on return the file decided (2, 3) is named in `TORCHREVIVE_SNAPSHOT_SECRET_FILE` of this
process's environment, so the keeper, the workers (which inherit it, never the secret) and a later
call agree; `TORCHREVIVE_SNAPSHOT_SECRET` is never left in it. A secret never reaches a message.

A file decided here (2, 3) is removed by the last process of the run on this host that used it, when it
exits (`release_held`): each holds a shared lock on it while it lives, and one that can take the lock
exclusively at its exit is the last. (Before, only a snapshot keeper removed it: a job with
TORCHREVIVE_SNAPSHOTS=0, or plain torchrun on c10d-sealed, left its secret on the host.) A keeper
removes it too, when the run's last keeper here stops.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import sys
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from elastic._shared.storage import peer_auth, secret_files
from elastic._shared.storage.peer_auth import PeerKey, SecretError

UNSIGNED_ENV = "TORCHREVIVE_UNSIGNED"
BASE_ENV = "TORCHREVIVE_SNAPSHOT_BASE"
DIRECTORY = "torchrevive-snapshots"
"""This user's private directory lies in `<base>/torchrevive-snapshots-<uid>` (`private_directory`)."""
HOW_TO_GIVE_ONE = (
    "write one to a file every agent can read (openssl rand -hex 32 > secret; chmod 600 secret) and give "
    f"{peer_auth.SECRET_FILE_ENV}=/path/to/secret (torchrevive-run --snapshot-secret-file; deploy/k8s mounts a "
    f"Secret, deploy/slurm makes one), or {UNSIGNED_ENV}=1 (torchrevive-run --unsigned) to run unsigned"
)


@dataclass(frozen=True)
class JobSecret:
    key: PeerKey | None
    """None: an unsigned job (asked for)."""
    made_here: Path | None
    """The file this host wrote the secret to (2 or 3 above), removed when the run's last keeper here stops."""


_HELD: dict[Path, tuple[int, int]] = {}
"""The secret files this process holds a shared lock on: path -> (descriptor, the pid that took it)."""


def hold(made: Path) -> None:
    """This process uses the secret file `made`: a shared lock on it while the process lives, so that the
    last user on this host removes it at exit (`release_held`)."""
    if made in _HELD:
        return
    try:
        descriptor = os.open(made, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # (removed meanwhile: nothing to hold)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH)
    except OSError:
        os.close(descriptor)
        return
    if not _HELD:
        atexit.register(release_held)
    _HELD[made] = (descriptor, os.getpid())


def release_held() -> None:
    """Remove each secret file this process holds when no other process holds it (and its directory when
    empty); close them all. Only in the process that took the lock: a forked child shares the lock and
    would remove the file from under its parent."""
    for made, (descriptor, pid) in list(_HELD.items()):
        del _HELD[made]
        if pid != os.getpid():
            os.close(descriptor)  # (closing a copy never unlocks: the parent's descriptor still holds it)
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # another agent of the run on this host still uses it
        else:
            with contextlib.suppress(OSError):
                made.unlink()
            with contextlib.suppress(OSError):
                made.parent.rmdir()  # when no other run's secret is left in it
        finally:
            os.close(descriptor)


def snapshot_base(environ: MutableMapping[str, str] | None = None) -> Path:
    """Where this user's private directory lies: TORCHREVIVE_SNAPSHOT_BASE, else /dev/shm (memory)."""
    env = os.environ if environ is None else environ
    given = env.get(BASE_ENV)
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def private_directory(base: Path) -> Path:
    """This user's directory under `base` (a shared /dev/shm): made with mode 0700, and refused
    (`SecretError`, a ValueError) unless it is a real directory of this user's, open to no one else, so
    no other local user can read the weights or the secret, or swap them."""
    directory = base / f"{DIRECTORY}-{os.geteuid()}"
    return secret_files.owned_directory(directory, f"cannot make the snapshot directory {directory}",
                                     f"{directory} is not a directory of this user's that only this user can open: "
                                     f"remove it, or set {BASE_ENV} to a directory of your own")


def one_host(endpoint: str | None, max_nodes: int) -> bool:
    """Whether every agent of the job runs on this host: at most one node, or a rendezvous endpoint on
    the loopback (which only this host reaches)."""
    if max_nodes <= 1:
        return True
    host = (endpoint or "").split(",")[0].strip()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def made_on_this_host(run_id: str, base: Path | None = None) -> JobSecret:
    """The secret this host makes for run `run_id` (3 above), the environment left as it is (for a keeper
    of a benchmark or a test in this process)."""
    made = secret_files.host_secret_file(private_directory(base or snapshot_base()), run_id)
    return JobSecret(PeerKey.from_file(made), made)


def resolve(
    run_id: str, *, endpoint: str | None, max_nodes: int, environ: MutableMapping[str, str] | None = None,
    base: Path | None = None,
) -> JobSecret:
    """The job's secret (see the module docstring); `SecretError` (one line) when it cannot be had."""
    env = os.environ if environ is None else environ
    named, given = env.get(peer_auth.SECRET_FILE_ENV), env.get(peer_auth.SECRET_ENV)
    if named:
        env.pop(peer_auth.SECRET_ENV, None)
        return JobSecret(PeerKey.from_file(Path(named)), None)
    directory = lambda: private_directory(base or snapshot_base(env))  # noqa: E731 - made only when needed
    if given:
        made = secret_files.given_secret_file(directory(), run_id, given.encode())
    elif one_host(endpoint, max_nodes):
        made = secret_files.host_secret_file(directory(), run_id)
    elif env.get(UNSIGNED_ENV) == "1":
        print(f"torchrevive: warning: run {run_id} is unsigned ({UNSIGNED_ENV}=1): anyone who reaches its "
              "rendezvous or worker stores can change what its agents and workers read there", file=sys.stderr,
              flush=True)
        return JobSecret(None, None)
    else:
        raise SecretError(f"run {run_id} may span hosts (--nnodes up to {max_nodes}, rendezvous {endpoint}) and has "
                          f"no secret to sign what its agents read from the network: {HOW_TO_GIVE_ONE}")
    key = PeerKey.from_file(made)
    hold(made)
    env[peer_auth.SECRET_FILE_ENV] = str(made)
    env.pop(peer_auth.SECRET_ENV, None)
    return JobSecret(key, made)


def for_rendezvous(run_id: str, *, endpoint: str | None, max_nodes: int) -> PeerKey | None:
    """The key a rendezvous handler signs with (`resolve` on this process's environment)."""
    return resolve(run_id, endpoint=endpoint, max_nodes=max_nodes).key
