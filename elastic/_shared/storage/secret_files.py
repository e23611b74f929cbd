"""The snapshot secret's files on a host: the one torchrevive-run makes for a run, and one given in the
environment, written for the run's workers to read.

Invariants:
- A secret file lives in `<base>/.secrets` (`SECRETS_DIRECTORY`), a directory of this user's, mode
  0700, that no one else can open; lstat checks it, so a link put in its place is refused
  (`SecretError`, one line, never showing the secret).
- A secret file is mode 0600, written whole or not at all (a new file renamed or linked into place),
  never through a link; a host-made one is made once and shared by the run's agents on the host.
- A run's two names (`host_secret_name`, `given_secret_name`) differ, and distinct run ids never
  share a name.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path

from elastic._shared.storage.peer_auth import SECRET_FILE_ENV, PeerKey, SecretError

SECRETS_DIRECTORY = ".secrets"
"""Where `host_secret_file` keeps the secrets made on a host, under the keepers' private directory."""


def host_secret_name(run_id: str) -> str:
    """The file name of run `run_id`'s secret made on a host (distinct for distinct run ids)."""
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id)[:48]
    return f"{name}-{hashlib.sha256(run_id.encode()).hexdigest()[:16]}"


def secrets_directory(base: Path) -> Path:
    """`base`/.secrets, made mode 0700; `SecretError` unless it is a directory of this user's that
    no one else can open (lstat: a link put in its place is refused)."""
    directory = base / SECRETS_DIRECTORY
    return owned_directory(directory, f"cannot keep the snapshot secret in {directory}",
                           f"{directory} belongs to another user or is open to others: "
                           f"set {SECRET_FILE_ENV} to a file only this user can read")


def owned_directory(directory: Path, cannot: str, refused: str) -> Path:
    """`directory`, made (with its parents) with mode 0700, and refused (`SecretError`: `cannot` with the
    system's reason, or `refused`) unless lstat finds a real directory of this user's that no one else can
    open (a link put in its place is refused)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise SecretError(f"{cannot}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise SecretError(refused)
    return directory


def given_secret_file(base: Path, run_id: str, secret: bytes) -> Path:
    """`secret` (given in the environment) written for run `run_id`'s workers to read, mode 0600, in
    `secrets_directory(base)`, under `given_secret_name`: whole or not at all (a new file renamed
    into place), never through a link. `SecretError` (never showing the secret) when it cannot be."""
    PeerKey(secret)  # its length checked before it is written anywhere
    directory = secrets_directory(base)
    path = directory / given_secret_name(run_id)
    tmp = directory / f".{path.name}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        os.replace(tmp, path)
    except OSError as exc:
        raise SecretError(f"cannot write the snapshot secret in {directory}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def given_secret_name(run_id: str) -> str:
    """The file name of run `run_id`'s secret given in the environment (never a host-made one's)."""
    return f"{host_secret_name(run_id)}.given"


def host_secret_file(base: Path, run_id: str) -> Path:
    """The secret of run `run_id` on this host, made once (32 random bytes, mode 0600, in a 0700
    directory of this user's under `base`) and shared by the run's agents here.

    `SecretError` when the directory belongs to another user or is open to others."""
    directory = secrets_directory(base)
    path = directory / host_secret_name(run_id)
    if not path.exists():
        tmp = directory / f".{path.name}.{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_hex(32).encode())
            try:
                os.link(tmp, path)  # whole or not at all; another agent of the run may have won
            except FileExistsError:
                pass
        except OSError as exc:
            raise SecretError(f"cannot write the snapshot secret in {directory}: {exc.strerror or exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return path
