"""The etcd-v3 rendezvous's options, read and checked before anything connects: no secret on the
command line, no credential in clear text, and run ids whose keys can never meet."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic._agent.rendezvous.handlers import create_etcd_v3 as _create_etcd_v3_handler
from elastic._agent.rendezvous.etcd_reopen import RunKeys
from elastic._agent.rendezvous.etcd_messages import prefix_end
from elastic._agent.rendezvous.etcd_options import (
    LAYOUT_NAMES,
    EtcdOptions,
    EtcdOptionsError,
    key_prefix,
    parse_endpoints,
)


def params(endpoint: str = "127.0.0.1:2379", run_id: str | None = None, **conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id or uuid.uuid4().hex, 1, 2, **conf)


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    """Files that exist (the options check only that; the client reads them)."""
    for name in ("ca.crt", "password"):
        (tmp_path / name).write_text("s3cret\n")
    return {"ca_cert": str(tmp_path / "ca.crt"), "password_file": str(tmp_path / "password")}


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"ttl": "soon"}, "ttl must be a positive integer"),
        ({"read_timeout": "0"}, "read_timeout must be a positive, finite number"),
        ({"read_timeout": "inf"}, "read_timeout must be a positive, finite number"),
        ({"read_timeout": "nan"}, "read_timeout must be a positive, finite number"),
        ({"ttl": "1.5"}, "ttl must be a positive integer"),
        ({"protocol": "ftp"}, "protocol must be http or https"),
        ({"protocol": "https", "ca_cert": "/no/such/ca.pem"}, "ca_cert: no such file"),
        ({"protocol": "https", "user": "alice"}, "user needs password_file"),
        ({"key_prefix": "/"}, "key_prefix must not be empty"),
    ],
)
def test_bad_options_are_one_clear_line(conf, message) -> None:
    with pytest.raises(EtcdOptionsError, match=message) as info:
        EtcdOptions.from_params(params(**conf))
    assert "\n" not in str(info.value)


def test_a_password_in_rdzv_conf_is_refused_pointing_to_password_file(tls_files) -> None:
    for conf in ({"password": "hunter2"}, {"user": "root", "password": "hunter2", "protocol": "https"}):
        with pytest.raises(EtcdOptionsError, match="give password_file=PATH instead") as info:
            EtcdOptions.from_params(params(**conf))
        assert "hunter2" not in str(info.value) and "\n" not in str(info.value)


def test_credentials_over_plain_http_are_refused(tls_files) -> None:
    for conf in ({"user": "root", "password_file": tls_files["password_file"]},
                 {"password_file": tls_files["password_file"]}, {"user": "root"}):
        with pytest.raises(EtcdOptionsError, match="clear text: .*add protocol=https,ca_cert="):
            EtcdOptions.from_params(params(**conf))


def test_a_password_file_over_https_is_read_and_kept_out_of_repr(tls_files) -> None:
    options = EtcdOptions.from_params(params(protocol="https", user="root", **tls_files))
    assert options.password == "s3cret" and options.user == "root"
    assert "s3cret" not in repr(options)
    with pytest.raises(EtcdOptionsError, match="password_file needs user"):
        EtcdOptions.from_params(params(protocol="https", **tls_files))


def test_torchrun_ends_on_a_bad_option_with_one_line_and_exit_2(capsys) -> None:
    """What torchrun's registry calls: nothing connects, no traceback, and the secret is not echoed."""
    with pytest.raises(SystemExit) as info:
        _create_etcd_v3_handler(params("127.0.0.1:1", password="hunter2"))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torchrun: error: --rdzv-backend=etcd-v3: rdzv-conf password=")
    assert "hunter2" not in err
    with pytest.raises(SystemExit):
        _create_etcd_v3_handler(params("127.0.0.1:1", liveness_ttl="0"))
    assert "liveness_ttl must be a positive integer" in capsys.readouterr().err


# --- run ids and key prefixes ------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["a/agents/x", "a/b", "", "../x", ".hidden", "a b", "a\nb", "x" * 129,
                                    "agents", "alive", "store", "store.ops", "rdzv", "a%2Fb", "é"])
def test_run_ids_that_could_reach_into_another_runs_keys_are_refused(run_id: str) -> None:
    with pytest.raises(EtcdOptionsError, match="rdzv-id") as info:
        EtcdOptions.from_params(params(run_id=run_id or None) if run_id else RendezvousParameters(
            "etcd-v3", "127.0.0.1:2379", "", 1, 2))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("run_id", ["job1", "gpt-1", "none", "12345", "a.b_c-d", "x" * 128, "agents2", "Store"])
def test_ordinary_run_ids_are_accepted(run_id: str) -> None:
    assert EtcdOptions.from_params(params(run_id=run_id)).key_prefix == f"/torchrevive/{run_id}"


@pytest.mark.parametrize("prefix", ["/p/agents/x", "/p/store", "/p/store.ops/q", "/rdzv", "agents"])
def test_key_prefixes_with_a_part_named_like_the_layout_are_refused(prefix: str) -> None:
    with pytest.raises(EtcdOptionsError, match="key_prefix .* has a part named"):
        key_prefix("job", prefix)


def run_keys(prefix: str) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """A run's keys (samples of each kind, store keys with '/' as torch writes them) and the
    ranges it reads, counts or deletes as its own."""
    keys = RunKeys(prefix.encode())
    store, ops = keys.store_ranges
    samples = [keys.state, store + b"torchelastic/0/rank/x", store + b"k", ops + b"ab12", keys.agents + b"ff00",
               keys.alive + b"host:12:0"]
    ranges = [(keys.state, keys.state + b"\0")] + [(r, prefix_end(r)) for r in (store, ops, keys.agents, keys.alive)]
    return samples, ranges


def test_no_two_accepted_runs_share_a_key_or_a_range() -> None:
    """Run ids and key prefixes built to collide (nested, sharing a stem, named like the layout's
    parts): of those accepted, no run's key falls in another's ranges."""
    words = ["a", "a.ops", "a-agents", "agents", "alive", "store", "store.ops", "rdzv", "x", "ag"]
    candidates = [("job", f"/t/{'/'.join(parts)}") for n in (1, 2, 3) for parts in itertools.product(words, repeat=n)]
    candidates += [(w, None) for w in words] + [("a", "/torchrevive"), ("b", "/torchrevive/a"), ("a", "/t/")]
    prefixes = set()
    for run_id, given in candidates:
        try:
            prefixes.add(key_prefix(run_id, given))
        except EtcdOptionsError:
            continue
    assert "/t/a/x" in prefixes and "/torchrevive/a" in prefixes and "/t/agents" not in prefixes
    layouts = {p: run_keys(p) for p in prefixes}
    for (one, (keys, _)), (other, (_, ranges)) in itertools.permutations(layouts.items(), 2):
        for key in keys:
            assert not any(low <= key < high for low, high in ranges), f"{key!r} of {one} is in a range of {other}"


def test_endpoints_parse_with_default_port_and_ipv6() -> None:
    assert [str(e) for e in parse_endpoints("a:1, b ,[::1]:3,[fe80::2]")] == ["a:1", "b:2379", "[::1]:3", "[fe80::2]:2379"]
    with pytest.raises(EtcdOptionsError, match="not a number"):
        parse_endpoints("host:port")
    with pytest.raises(EtcdOptionsError, match="needs --rdzv-endpoint"):
        parse_endpoints("")


def test_endpoints_may_be_urls_whose_scheme_matches_the_protocol() -> None:
    options = EtcdOptions.from_params(params("http://a:1,http://b:2/"))
    assert [str(e) for e in options.endpoints] == ["a:1", "b:2"]
    with pytest.raises(EtcdOptionsError, match="add protocol=https"):
        EtcdOptions.from_params(params("https://a:1"))


def test_the_layout_names_are_the_ones_the_keys_use() -> None:
    keys = RunKeys(b"/p")
    after = {k[len(b"/p/"):].split(b"/")[0].decode() for k in (keys.state, *keys.store_ranges, keys.agents, keys.alive)}
    assert after == LAYOUT_NAMES
