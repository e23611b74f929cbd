"""The etcd-v3 rendezvous backend's contract, against a real etcd."""

from __future__ import annotations

import pickle
import time
import uuid

import pytest
from etcd_server import EtcdServer, login_conf, make_tls
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

from elastic._agent.rendezvous.etcd import (
    BACKEND_NAME,
    create_backend,
    decode_state,
    encode_state,
)
from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_options import EtcdOptions


def params(endpoint: str, run_id: str | None = None, **conf: object) -> RendezvousParameters:
    return RendezvousParameters(
        backend=BACKEND_NAME,
        endpoint=endpoint,
        run_id=run_id or uuid.uuid4().hex,
        min_nodes=1,
        max_nodes=2,
        **conf,
    )


@pytest.fixture
def backend(shared_etcd):
    backend, _store = create_backend(params(shared_etcd.endpoint, read_timeout=10))
    yield backend
    backend._client.close()


def test_name_is_etcd_v3(backend) -> None:
    assert backend.name == "etcd-v3"


def test_get_state_is_none_when_no_state_exists(backend) -> None:
    assert backend.get_state() is None


def test_set_state_without_token_sets_when_absent(backend) -> None:
    state, token, written = backend.set_state(b"first")
    assert (state, written) == (b"first", True)
    assert backend.get_state() == (b"first", token)


def test_set_state_with_current_token_sets_and_returns_a_new_token(backend) -> None:
    _, token, _ = backend.set_state(b"first")
    state, new_token, written = backend.set_state(b"second", token)
    assert (state, written) == (b"second", True)
    assert new_token != token
    assert backend.get_state() == (b"second", new_token)


def test_set_state_with_old_token_does_not_set(backend) -> None:
    _, old, _ = backend.set_state(b"first")
    _, current, _ = backend.set_state(b"second", old)
    assert backend.set_state(b"third", old) == (b"second", current, False)
    assert backend.get_state() == (b"second", current)


def test_set_state_with_none_token_when_state_exists_does_not_set(backend) -> None:
    _, token, _ = backend.set_state(b"first")
    assert backend.set_state(b"other") == (b"first", token, False)


@pytest.mark.parametrize("bad_token", ["not-a-number", -3, 0, 10**12, object()])
def test_set_state_with_invalid_token_does_not_set(backend, bad_token) -> None:
    _, token, _ = backend.set_state(b"first")
    assert backend.set_state(b"other", bad_token) == (b"first", token, False)


def test_set_state_with_a_token_when_no_state_exists_returns_none(backend) -> None:
    assert backend.set_state(b"x", 12345) is None
    assert backend.get_state() is None


def test_concurrent_writers_with_the_same_token_only_one_wins(shared_etcd) -> None:
    run_id = uuid.uuid4().hex
    first, _ = create_backend(params(shared_etcd.endpoint, run_id))
    second, _ = create_backend(params(shared_etcd.endpoint, run_id))
    # Real states: what the loser is told is what its guard admitted (elastic._agent.rendezvous.state_guard).
    base, mine, theirs = (pickle.dumps(_state_of_round(n)) for n in (1, 2, 3))
    _, token, _ = first.set_state(base)
    outcomes = [first.set_state(mine, token), second.set_state(theirs, token)]
    assert [written for *_, written in outcomes] == [True, False]
    assert outcomes[1][:2] == outcomes[0][:2]  # the loser is told the winner's state and token


def _state_of_round(number: int) -> _RendezvousState:
    state = _RendezvousState()
    state.round = number
    return state


def test_corrupted_value_raises_state_error(backend, shared_etcd) -> None:
    backend.set_state(b"good")
    key = backend._key.decode()
    shared_etcd.put(key, "garbage written by hand")
    with pytest.raises(RendezvousStateError, match="not a torchrevive state"):
        backend.get_state()
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"new")  # the failure branch returns the corrupt value


def test_flipped_byte_in_state_is_detected() -> None:
    framed = bytearray(encode_state(b"pickled rendezvous state"))
    framed[-1] ^= 0x01
    with pytest.raises(RendezvousStateError, match="checksum"):
        decode_state(bytes(framed), "here")
    assert decode_state(encode_state(b"\x00\xffabc"), "here") == b"\x00\xffabc"


def test_keys_live_under_the_run_prefix(shared_etcd) -> None:
    run_id = uuid.uuid4().hex
    backend, store = create_backend(params(shared_etcd.endpoint, run_id))
    backend.set_state(b"s")
    store.set("k", "v")
    keys = shared_etcd.keys(f"/torchrevive/{run_id}")
    assert keys == [f"/torchrevive/{run_id}/rdzv/state", f"/torchrevive/{run_id}/store/k"]


def test_key_prefix_option_moves_the_keys(shared_etcd) -> None:
    prefix = f"/custom/{uuid.uuid4().hex}"
    backend, _ = create_backend(params(shared_etcd.endpoint, key_prefix=prefix))
    backend.set_state(b"s")
    assert shared_etcd.keys(f"{prefix}/rdzv/state", prefix=False) == [f"{prefix}/rdzv/state"]


def test_keys_of_an_abandoned_run_expire_after_ttl(shared_etcd) -> None:
    ttl = 4
    run_id = uuid.uuid4().hex
    backend, store = create_backend(params(shared_etcd.endpoint, run_id, ttl=ttl))
    backend.set_state(b"s")
    store.set("k", "v")
    # The keep-alive thread renews every ttl/3 s, so the keys outlive the ttl unless
    # it is starved for 2/3 of the ttl (2.7 s): the margin left for a busy machine.
    time.sleep(ttl + 1)
    assert backend.get_state()[0] == b"s" and store.check(["k"])  # kept alive while the process lives
    backend._client.close(revoke=False)  # as if the process died: nobody keeps the lease alive
    prefix = f"/torchrevive/{run_id}/"
    deadline = time.monotonic() + ttl + 30  # etcd expires a lease on its own schedule: a wide margin
    while shared_etcd.keys(prefix) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert shared_etcd.keys(prefix) == []


def test_failover_skips_a_dead_endpoint(shared_etcd) -> None:
    from support import free_port

    dead = f"127.0.0.1:{free_port()}"
    backend, _ = create_backend(params(f"{dead},{shared_etcd.endpoint}", read_timeout=10))
    _, token, written = backend.set_state(b"via the second endpoint")
    assert written and backend.get_state() == (b"via the second endpoint", token)


def test_unreachable_etcd_raises_connection_error_naming_the_endpoint() -> None:
    from support import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    # Within its read_timeout (1.5 s), not the client's or torch's default.
    with pytest.raises(RendezvousConnectionError, match=rf"cannot reach etcd at {endpoint} .*within 1\.5 s.*Connection refused"):
        create_backend(params(endpoint, read_timeout=1.5))


def test_closing_a_client_revokes_its_lease_so_its_keys_go_at_once(shared_etcd) -> None:
    client = EtcdClient(EtcdOptions.from_params(params(shared_etcd.endpoint)))
    key = f"/probe/{uuid.uuid4().hex}"
    client.txn([], [client.put_op(key.encode(), b"v")], [], what="write")
    assert shared_etcd.value(key) == "v"
    client.close()
    assert shared_etcd.value(key) is None  # not ttl (7200 s) later
    client.close()  # closing twice does nothing
    with pytest.raises(RendezvousConnectionError, match="cannot read: the etcd client is closed"):
        client.get(key.encode())


def test_closing_without_revoking_leaves_the_keys_to_the_ttl(shared_etcd) -> None:
    client = EtcdClient(EtcdOptions.from_params(params(shared_etcd.endpoint)))
    key = f"/probe/{uuid.uuid4().hex}"
    client.txn([], [client.put_op(key.encode(), b"v")], [], what="write")
    client.close(revoke=False)
    assert shared_etcd.value(key) == "v"
    assert shared_etcd.lease_ttl(client.lease_id) == 7200
    shared_etcd.revoke_lease(client.lease_id)


def test_torchrun_finds_etcd_v3_through_the_entry_point(shared_etcd, tmp_path) -> None:
    """What `torchrun --rdzv-backend=etcd-v3` does: the registry loads the installed entry points
    (c10d-sealed too) and builds the factory's handler (torch's dynamic rendezvous) on this backend."""
    import os
    import subprocess
    import sys

    script = (
        "import elastic._agent.rendezvous.etcd\n"  # first, as a training script might: no import cycle
        "from torch.distributed.elastic.rendezvous import registry, rendezvous_handler_registry\n"
        "from torch.distributed.elastic.rendezvous.api import RendezvousParameters\n"
        f"p = RendezvousParameters('etcd-v3', '{shared_etcd.endpoint}', 'entry-point', 1, 1)\n"
        "handler = registry.get_rendezvous_handler(p)\n"
        "print(type(handler).__name__, handler.get_backend(), 'c10d-sealed' in rendezvous_handler_registry._registry)\n"
    )
    secret = tmp_path / "secret"
    secret.write_text("e" * 32)
    env = {**os.environ, "TORCHREVIVE_SNAPSHOT_SECRET_FILE": str(secret)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["SealedHandler", "etcd-v3", "True"]
    assert "Exception while registering" not in done.stderr


def test_writes_go_on_after_the_lease_is_lost(shared_etcd) -> None:
    backend, store = create_backend(params(shared_etcd.endpoint))
    _, token, _ = backend.set_state(b"before")
    shared_etcd.revoke_lease(backend._client.lease_id)  # its keys go with it
    assert backend.get_state() is None
    _, token, written = backend.set_state(b"after")
    store.set("k", "v")
    assert written and backend.get_state() == (b"after", token)


def test_auth_token_is_renewed_after_etcd_restarts(tmp_path) -> None:
    etcd = EtcdServer(tmp_path / "etcd-data", tls=make_tls(tmp_path / "pki"))
    etcd.start()
    try:
        etcd.enable_auth(root_password="pw")
        backend, store = create_backend(params(etcd.endpoint, read_timeout=20, **login_conf(etcd.tls, "pw", tmp_path)))
        backend.set_state(b"s")
        etcd.stop()
        etcd.start()  # simple tokens do not survive a restart
        assert backend.get_state()[0] == b"s"
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        etcd.stop()


def test_runs_with_nested_prefixes_never_see_each_others_keys(shared_etcd) -> None:
    """Before run ids were checked, run `a/agents/x` wrote under run `a`'s agents/ range (a live
    agent to `a` for ever) and `a/store` into `a`'s store. Such ids are refused now, and nested
    prefixes that are accepted keep apart: counts, agent lists and a reopen see one run only."""
    from elastic._agent.rendezvous.etcd_liveness import AgentPresence
    from elastic._agent.rendezvous.etcd_reopen import RunKeys, _live_agents, _remove_closed_run
    from elastic._agent.rendezvous.etcd_options import EtcdOptionsError

    outer_id = uuid.uuid4().hex
    for nested in (f"{outer_id}/agents/x", f"{outer_id}/store"):
        with pytest.raises(EtcdOptionsError, match="rdzv-id"):
            create_backend(params(shared_etcd.endpoint, nested))
    with pytest.raises(EtcdOptionsError, match="has a part named 'agents'"):
        create_backend(params(shared_etcd.endpoint, key_prefix=f"/torchrevive/{outer_id}/agents/x"))

    outer = create_backend(params(shared_etcd.endpoint, outer_id))
    inner = create_backend(params(shared_etcd.endpoint, "inner", key_prefix=f"/torchrevive/{outer_id}/inner"))
    presences = []
    for backend, store in (outer, inner):
        backend.set_state(b"state")
        store.set("k", "v")
        store.add("counter", 1)
        options = backend.client.options
        presence = AgentPresence(options, RunKeys(options.key_prefix.encode()).agents, 10)
        presence.enter()
        presences.append(presence)
    try:
        for backend, store in (outer, inner):
            keys = RunKeys(backend.client.options.key_prefix.encode())
            assert store.num_keys() == 2
            assert len(_live_agents(backend.client, keys)) == 1
        presences[0].leave()  # the outer run's agent is gone: it may reopen, the inner run must stay
        _, token = outer[0].get_state()
        assert _remove_closed_run(outer[0].client, RunKeys(outer[0].client.options.key_prefix.encode()), token)
        assert outer[0].get_state() is None and outer[1].num_keys() == 0
        assert inner[0].get_state()[0] == b"state" and inner[1].get("k") == b"v" and inner[1].num_keys() == 2
    finally:
        presences[1].leave()
        for backend, _ in (outer, inner):
            backend.client.close()
