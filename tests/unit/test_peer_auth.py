"""The job's secret and the signatures made with it (storage/peer_auth.py), in one process."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from elastic._shared.storage import peer_auth
from elastic._shared.storage.peer_auth import (
    PeerKey,
    Refused,
    RequestVerifier,
    SecretError,
)

SECRET = b"0123456789abcdef0123456789abcdef"


def headers_of(key: PeerKey, method: str, path: str, **kwargs: object) -> dict[str, str]:
    signed = key.sign(method, path, **kwargs)  # type: ignore[arg-type]
    extra = {}
    if "content_length" in kwargs:
        extra["Content-Length"] = str(kwargs["content_length"])
    if "header_bytes" in kwargs:
        extra["X-Header-Bytes"] = str(kwargs["header_bytes"])
    return {**signed, **extra}


def test_a_signed_request_passes_once_and_every_change_fails() -> None:
    key = PeerKey(SECRET)
    verifier = RequestVerifier(key)
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
            RequestVerifier(key).check("PUT", "/replica/x", {**fresh, **changed})
        assert refused.value.status == 403, changed
    for method, path in (("GET", "/replica/x"), ("PUT", "/replica/y")):
        with pytest.raises(Refused):
            RequestVerifier(key).check(method, path, fresh)
    with pytest.raises(Refused) as unsigned:
        verifier.check("GET", "/part/local/x", {})
    assert unsigned.value.status == 401
    old = headers_of(key, "GET", "/p", now=1_000_000)
    with pytest.raises(Refused, match="outside"):
        verifier.check("GET", "/p", old)
    with pytest.raises(Refused):
        RequestVerifier(PeerKey(b"another secret of the right size")).check("GET", "/p", headers_of(key, "GET", "/p"))


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
    first = peer_auth.host_secret_file(tmp_path, "run/a")
    assert peer_auth.host_secret_file(tmp_path, "run/a") == first  # the run's other agents on this host
    other = peer_auth.host_secret_file(tmp_path, "run_a")  # names that look alike stay apart
    assert other != first and other.read_bytes() != first.read_bytes()
    assert stat.S_IMODE(first.stat().st_mode) == 0o600 and stat.S_IMODE(first.parent.stat().st_mode) == 0o700
    assert PeerKey.from_file(first) is not None
    os.chmod(first.parent, 0o755)
    with pytest.raises(SecretError, match="open to others"):
        peer_auth.host_secret_file(tmp_path, "run/b")
