"""The job's secret and the signatures made with it (storage/peer_auth.py), in one process."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from elastic._shared.storage import peer_auth, secret_files
from elastic._shared.storage.peer_auth import (
    PeerKey,
    Refused,
    RequestVerifier,
    SecretError,
)

SECRET = b"0123456789abcdef0123456789abcdef"
KEEPER = "10.0.0.1:4242"
"""The keeper these tests' requests are signed for."""


def headers_of(key: PeerKey, method: str, path: str, **kwargs: object) -> dict[str, str]:
    signed = key.sign(method, path, **{"receiver": KEEPER, **kwargs})  # type: ignore[arg-type]
    extra = {}
    if "content_length" in kwargs:
        extra["Content-Length"] = str(kwargs["content_length"])
    if "header_bytes" in kwargs:
        extra["X-Header-Bytes"] = str(kwargs["header_bytes"])
    return {**signed, **extra}


def test_a_signed_request_passes_once_and_every_change_fails() -> None:
    key = PeerKey(SECRET)
    verifier = RequestVerifier(key, KEEPER)
    good = headers_of(key, "PUT", "/replica/x", content_length=100, header_bytes=10)
    assert verifier.check("PUT", "/replica/x", good) == good[peer_auth.NONCE]
    with pytest.raises(Refused) as replayed:
        verifier.check("PUT", "/replica/x", good)
    assert replayed.value.status == 403
    fresh = headers_of(key, "PUT", "/replica/x", content_length=100, header_bytes=10)
    for changed in (
        {"Content-Length": "101"}, {"X-Header-Bytes": "11"}, {peer_auth.TIME: str(int(fresh[peer_auth.TIME]) + 1)},
        {peer_auth.NONCE: "0" * 32}, {peer_auth.SIGNATURE: "0" * 64},
    ):
        with pytest.raises(Refused) as refused:
            RequestVerifier(key, KEEPER).check("PUT", "/replica/x", {**fresh, **changed})
        assert refused.value.status == 403, changed
    for method, path in (("GET", "/replica/x"), ("PUT", "/replica/y")):
        with pytest.raises(Refused):
            RequestVerifier(key, KEEPER).check(method, path, fresh)
    with pytest.raises(Refused) as unsigned:
        verifier.check("GET", "/part/local/x", {})
    assert unsigned.value.status == 401
    old = headers_of(key, "GET", "/p", now=1_000_000)
    with pytest.raises(Refused, match="outside"):
        verifier.check("GET", "/p", old)
    with pytest.raises(Refused):
        RequestVerifier(PeerKey(b"another secret of the right size"), KEEPER).check("GET", "/p", headers_of(key, "GET", "/p"))


def test_a_body_tag_is_bound_to_its_nonce_and_what_it_answers() -> None:
    key = PeerKey(SECRET)
    tag = key.body_tag("a" * 32, peer_auth.response_what("/p", 206, 0, 10, 100))
    tag.update(b"0123456789")
    made = tag.finalize()
    for nonce, what, body, ok in (
        ("a" * 32, peer_auth.response_what("/p", 206, 0, 10, 100), b"0123456789", True),
        ("b" * 32, peer_auth.response_what("/p", 206, 0, 10, 100), b"0123456789", False),
        ("a" * 32, peer_auth.response_what("/p", 206, 1, 11, 100), b"0123456789", False),
        ("a" * 32, peer_auth.response_what("/p", 206, 0, 10, 100), b"0123456788", False),
    ):
        check = key.body_tag(nonce, what)
        check.update(body)
        assert peer_auth.check_tag(check, made) is ok


def test_the_secret_comes_from_a_file_or_the_environment_and_never_shows(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    key = PeerKey.from_env({peer_auth.SECRET_FILE_ENV: str(secret_file)})
    assert key is not None and SECRET.decode() not in repr(key) and "secret" in repr(key)
    assert PeerKey.from_env({peer_auth.SECRET_ENV: SECRET.decode()}) is not None
    assert PeerKey.from_env({}) is None
    with pytest.raises(SecretError, match="cannot read the snapshot secret file") as missing:
        PeerKey.from_env({peer_auth.SECRET_FILE_ENV: str(tmp_path / "gone")})
    assert "\n" not in str(missing.value)
    (tmp_path / "short").write_bytes(b"tooshort")
    with pytest.raises(SecretError, match="16 to 4096 bytes") as short:
        PeerKey.from_file(tmp_path / "short")
    assert "tooshort" not in str(short.value)


def test_a_hosts_secret_is_made_once_per_run_private_to_its_user(tmp_path: Path) -> None:
    first = secret_files.host_secret_file(tmp_path, "run/a")
    assert secret_files.host_secret_file(tmp_path, "run/a") == first  # the run's other agents on this host
    other = secret_files.host_secret_file(tmp_path, "run_a")  # names that look alike stay apart
    assert other != first and other.read_bytes() != first.read_bytes()
    assert stat.S_IMODE(first.stat().st_mode) == 0o600 and stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    assert PeerKey.from_file(first) is not None
    os.chmod(first.parent, 0o755)
    with pytest.raises(SecretError, match="open to others"):
        secret_files.host_secret_file(tmp_path, "run/b")


def test_a_request_signed_for_one_keeper_is_refused_by_every_other() -> None:
    key = PeerKey(SECRET)
    url = "http://10.0.0.1:4242/part/local/x"
    assert peer_auth.receiver_of(url) == KEEPER == peer_auth.receiver("10.0.0.1", 4242)
    assert peer_auth.receiver_of("https://[FD00::1]:7/p") == peer_auth.receiver("fd00::1", 7) == "[fd00::1]:7"
    signed = headers_of(key, "GET", "/part/local/x")
    for other in ("10.0.0.2:4242", "10.0.0.1:4243", ""):  # another node's keeper, another agent's on the host
        with pytest.raises(Refused, match="another keeper") as refused:
            RequestVerifier(key, other).check("GET", "/part/local/x", signed)
        assert refused.value.status == 403
    assert RequestVerifier(key, KEEPER).check("GET", "/part/local/x", signed) == signed[peer_auth.NONCE]


class Clock:
    """Unix seconds the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_nonces_are_forgotten_with_their_window_and_many_requests_are_never_refused() -> None:
    key = PeerKey(SECRET)
    clock = Clock(1_700_000_000.0)
    verifier = RequestVerifier(key, KEEPER, clock=clock)
    first = headers_of(key, "GET", "/p", now=clock.now)
    verifier.check("GET", "/p", first)
    # Past 65,536 requests within the window (the old cache's limit): every fresh one is served.
    for i in range(70_000):
        clock.now += 0.001
        verifier.check("GET", "/p", headers_of(key, "GET", "/p", now=clock.now))
    assert verifier.remembered == 70_001
    with pytest.raises(Refused, match="replayed"):
        verifier.check("GET", "/p", first)
    # Once the window has passed, what it remembered is forgotten: the time check refuses those now.
    clock.now += peer_auth.WINDOW + 1
    verifier.check("GET", "/p", headers_of(key, "GET", "/p", now=clock.now))
    assert verifier.remembered == 1
    with pytest.raises(Refused, match="outside"):
        verifier.check("GET", "/p", first)


def test_past_its_limit_the_memory_forgets_the_oldest_second_and_never_accepts_a_replay() -> None:
    key = PeerKey(SECRET)
    clock = Clock(1_700_000_000.0)
    verifier = RequestVerifier(key, KEEPER, clock=clock, max_nonces=100)
    old = [headers_of(key, "GET", "/p", now=clock.now - 60) for _ in range(50)]
    for signed in old:
        verifier.check("GET", "/p", signed)
    for _ in range(200):  # a burst of fresh requests, twice the limit: all served
        verifier.check("GET", "/p", headers_of(key, "GET", "/p", now=clock.now))
    assert verifier.remembered <= 200
    for signed in old[:3]:  # forgotten, but their second is below the floor: still refused
        with pytest.raises(Refused, match="oldest second"):
            verifier.check("GET", "/p", signed)
    with pytest.raises(Refused, match="oldest second"):  # a new request as old as the forgotten ones
        verifier.check("GET", "/p", headers_of(key, "GET", "/p", now=clock.now - 60))
    clock.now += 1
    for _ in range(150):  # the next second's: the burst's second goes, and nothing fresh is refused
        verifier.check("GET", "/p", headers_of(key, "GET", "/p", now=clock.now))
    assert verifier.remembered == 150
