"""The job's secret (elastic._shared.storage.job_secret): given as TORCHREVIVE_SNAPSHOT_SECRET it never
reaches the workers' environment (moved to a 0600 file in this user's 0700 snapshot directory, named in
TORCHREVIVE_SNAPSHOT_SECRET_FILE, which the workers inherit); a job on one host signs with a secret the
host makes; a job that may span hosts without one stops in one line, unless it asks to run unsigned."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
from pathlib import Path

import pytest

from elastic._agent.launcher import keeper_files
from elastic._shared.storage import job_secret, peer_auth
from elastic._shared.storage.peer_auth import SECRET_ENV, SECRET_FILE_ENV, PeerKey

SECRET = "s3cret-" + "x" * 40


@pytest.fixture
def environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's environment as an agent's with the secret given in it; the snapshot base."""
    base = tmp_path / "shm"
    monkeypatch.setenv(keeper_files.BASE_ENV, str(base))
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(SECRET_FILE_ENV, "")
    return base


def signature(key: PeerKey | None) -> str:
    assert key is not None
    return key.record_tag("round", "key", "value")


def resolve(run_id: str, endpoint: str = "10.0.0.1:29400", max_nodes: int = 2) -> tuple[PeerKey | None, Path | None]:
    found = job_secret.resolve(run_id, endpoint=endpoint, max_nodes=max_nodes)
    return found.key, found.made_here


def test_a_secret_given_in_the_environment_reaches_the_workers_as_a_private_file(environ: Path) -> None:
    key, secret_file = resolve("run-a")
    assert SECRET_ENV not in os.environ  # workers started from now on do not inherit it
    assert secret_file is not None and os.environ[SECRET_FILE_ENV] == str(secret_file)
    info = os.lstat(secret_file)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert secret_file.read_text() == SECRET
    assert secret_file.parent.parent == keeper_files.private_directory(environ)  # mode 0700, this user's
    worker = PeerKey.from_env(dict(os.environ))  # how a worker finds it
    assert worker is not None and signature(worker) == signature(key) == signature(PeerKey(SECRET.encode()))


def test_the_given_secrets_file_outlives_the_hourly_cleanup_while_its_keeper_runs(
        environ: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, secret_file = resolve("run-a")
    old = time.time() - 2 * keeper_files.STALE_SECRET
    os.utime(secret_file, (old, old))
    keeper_files.remove_orphans(keeper_files.private_directory(environ))
    assert not secret_file.exists()  # no keeper of run-a: removed
    monkeypatch.setenv(SECRET_ENV, SECRET)  # another agent, of run-b
    monkeypatch.setenv(SECRET_FILE_ENV, "")
    _, secret_file = resolve("run-b")
    os.utime(secret_file, (old, old))
    keeper = keeper_files.private_directory(environ) / "keeper"
    keeper.mkdir()
    (keeper / keeper_files.OWNER_FILE).write_text(json.dumps(keeper_files.owner_record("run-b")))
    keeper_files.remove_orphans(keeper_files.private_directory(environ))
    assert secret_file.exists()


def test_a_secret_file_given_is_handed_on_as_it_is(environ: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    given = tmp_path / "secret"
    given.write_text("y" * 32)
    monkeypatch.setenv(SECRET_FILE_ENV, str(given))
    key, secret_file = resolve("run-a")
    assert secret_file is None and os.environ[SECRET_FILE_ENV] == str(given) and SECRET_ENV not in os.environ
    assert signature(key) == signature(PeerKey(b"y" * 32))


def test_a_bad_secret_in_the_environment_is_one_line_that_does_not_show_it(environ: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(peer_auth.SecretError) as raised:
        resolve("run-a")
    assert "short" not in str(raised.value) and "\n" not in str(raised.value)


def test_a_secret_that_cannot_be_kept_in_a_file_stays_where_it_was(environ: Path) -> None:
    """No private directory to write it to (another user's): the keeper does not start, and the
    agent keeps sealing its records with the secret, from the environment as before."""
    environ.mkdir(parents=True)
    (environ / f"{keeper_files.DIRECTORY}-{os.geteuid()}").mkdir(mode=0o755)
    with pytest.raises(peer_auth.SecretError, match="open to no one else|not a directory of this user's"):
        resolve("run-a")
    assert os.environ[SECRET_ENV] == SECRET and not os.environ[SECRET_FILE_ENV]


def test_a_job_on_one_host_signs_with_a_secret_the_host_makes_for_the_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(keeper_files.BASE_ENV, str(tmp_path / "shm"))
    for name in (SECRET_ENV, SECRET_FILE_ENV, job_secret.UNSIGNED_ENV):
        monkeypatch.setenv(name, "")  # recorded as found (monkeypatch records nothing for a delenv of an absent name),
        monkeypatch.delenv(name)  # so the file resolve names in os.environ below is taken back after the test
    key, made = resolve("run-a", endpoint="127.0.0.1:29400")
    assert made is not None and os.environ[SECRET_FILE_ENV] == str(made) and stat.S_IMODE(made.stat().st_mode) == 0o600
    monkeypatch.delenv(SECRET_FILE_ENV)  # another agent of the run on this host: the same secret
    again, _ = resolve("run-a", endpoint="localhost:29400")
    assert signature(again) == signature(key)
    for endpoint, nodes in (("[::1]:29400", 4), ("node7:29400", 1)):
        monkeypatch.delenv(SECRET_FILE_ENV)
        assert resolve("run-a", endpoint=endpoint, max_nodes=nodes)[0] is not None


def test_a_job_that_may_span_hosts_without_a_secret_stops_in_one_line_unless_unsigned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(keeper_files.BASE_ENV, str(tmp_path / "shm"))
    for name in (SECRET_ENV, SECRET_FILE_ENV, job_secret.UNSIGNED_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(peer_auth.SecretError) as raised:
        resolve("run-a", endpoint="node1:29400", max_nodes=4)
    line = str(raised.value)
    assert "\n" not in line and SECRET_FILE_ENV in line and "deploy/k8s" in line and job_secret.UNSIGNED_ENV in line
    assert not (tmp_path / "shm").exists()  # nothing made for it
    monkeypatch.setenv(job_secret.UNSIGNED_ENV, "1")
    assert resolve("run-a", endpoint="node1:29400", max_nodes=4) == (None, None)
    assert "is unsigned" in capsys.readouterr().err and SECRET_FILE_ENV not in os.environ


def test_the_last_process_of_the_run_on_this_host_removes_the_secret_the_host_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only a keeper: a job without one (TORCHREVIVE_SNAPSHOTS=0, plain torchrun on c10d-sealed) left the
    secret it made on the host. Each agent holds a shared lock on it; the one that can take it alone at exit
    removes it. A forked child (the workers' fork server) shares its parent's lock and never removes it."""
    monkeypatch.setenv(keeper_files.BASE_ENV, str(tmp_path / "shm"))
    for name in (SECRET_ENV, SECRET_FILE_ENV, job_secret.UNSIGNED_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    _, made = resolve("run-b", endpoint="127.0.0.1:29400")
    assert made is not None and made.exists()
    other = os.open(made, os.O_RDONLY)  # another agent of the run on this host
    fcntl.flock(other, fcntl.LOCK_SH)
    job_secret.release_held()
    assert made.exists()
    os.close(other)
    job_secret.hold(made)
    with monkeypatch.context() as child:
        child.setattr(job_secret.os, "getpid", lambda: -1)
        job_secret.release_held()
    assert made.exists()
    job_secret.hold(made)
    job_secret.release_held()
    assert not made.exists() and not made.parent.exists()
