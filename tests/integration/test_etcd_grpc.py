"""The etcd-v3 client on gRPC and the store's watch-based waits, against a real etcd."""

from __future__ import annotations

import logging
import re
import sys
import threading
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
import warm
from etcd_server import EtcdServer, login_conf, make_tls
from support import REPO, free_port, worker_env
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)

from elastic._agent.rendezvous.etcd import create_backend
from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_messages import (
    encode,
    key_values,
    prefix_end,
    txn_range_results,
)
from elastic._agent.rendezvous.etcd_options import EtcdOptions
from elastic._agent.rendezvous.etcd_store import EtcdStore


def params(endpoint: str, **conf: object) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, uuid.uuid4().hex, 1, 1, **conf)


@pytest.fixture
def client(shared_etcd):
    client = EtcdClient(EtcdOptions.from_params(params(shared_etcd.endpoint, read_timeout=10)))
    yield client
    client.close()


@pytest.fixture
def store(client) -> EtcdStore:
    return EtcdStore(client, f"/store-test/{uuid.uuid4().hex}/".encode(), timeout=timedelta(seconds=10))


def count_reads(store: EtcdStore) -> list[str]:
    """Record the reads of store keys sent through the store's client."""
    sent: list[str] = []
    real = store._client.txn

    def txn(*args, **kwargs):
        if kwargs.get("what") == "read store keys":
            sent.append("read")
        return real(*args, **kwargs)

    store._client.txn = txn  # type: ignore[method-assign]
    return sent


def before_the_watch(store: EtcdStore, action) -> None:
    """Run `action` after the store's read and before its watch starts."""
    real = store._client.watch

    def watch(*args, **kwargs):
        action()
        return real(*args, **kwargs)

    store._client.watch = watch  # type: ignore[method-assign]


# --- watch-based waits ---------------------------------------------------------------


def test_a_wait_that_a_later_set_satisfies_reads_once_then_watches(store) -> None:
    writer = store.clone()
    reads = count_reads(store)
    timer = threading.Timer(0.5, writer.set, ("late", "arrived"))
    timer.start()
    store.wait(["late"])
    assert store.get("late") == b"arrived"
    timer.join()
    assert reads == ["read", "read"]  # the wait's read, then the get's: no polling


def test_a_write_between_the_read_and_the_watch_is_not_missed(store) -> None:
    before_the_watch(store, lambda: store.clone().set("k", "v"))
    assert store.get("k") == b"v"  # the watch starts at the read's revision + 1


def test_a_key_deleted_after_the_read_counts_as_missing_again(store) -> None:
    store.set("a", "1")
    other = store.clone()
    before_the_watch(store, lambda: (other.delete_key("a"), other.set("b", "x")))
    timer = threading.Timer(0.3, other.set, ("a", "2"))
    timer.start()
    assert store.multi_get(["a", "b"]) == [b"2", b"x"]
    timer.join()


def test_a_wait_that_times_out_names_what_is_missing_in_one_line(store) -> None:
    store.set("here", "1")
    with pytest.raises(dist.DistStoreError) as info:
        store.wait(["here", "never"], timedelta(milliseconds=300))
    assert str(info.value).startswith("wait timeout after ")
    assert str(info.value).endswith("ms, keys: never (etcd store)")


def test_a_wait_on_more_keys_than_one_transaction_takes(store) -> None:
    keys = [f"node{i}" for i in range(300)]  # etcd's --max-txn-ops is 128
    reads = count_reads(store)
    timer = threading.Timer(0.3, store.clone().multi_set, (keys, [str(i) for i in range(300)]))
    timer.start()
    assert store.multi_get(keys) == [str(i).encode() for i in range(300)]
    timer.join()
    assert len(reads) == 3  # one snapshot in three transactions at one revision, then the watch


def test_a_wait_outlasts_an_etcd_restart(etcd) -> None:
    _, store = create_backend(params(etcd.endpoint, read_timeout=30))
    writer = store.clone()
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(store.get("after-restart")))
    waiter.start()
    etcd.stop()
    etcd.start()
    writer.set("after-restart", "yes")  # retried until etcd is back
    waiter.join(60)
    assert got == [b"yes"]


def test_the_store_waits_read_timeout_by_default(shared_etcd) -> None:
    _, store = create_backend(params(shared_etcd.endpoint, read_timeout=7))
    assert store.timeout == timedelta(seconds=7)


# --- clone and torch's extended API ----------------------------------------------------


def test_clone_shares_the_keys_and_has_its_own_timeout(store) -> None:
    twin = store.clone()
    assert isinstance(twin, dist.Store) and twin is not store
    store.set("k", "v")
    assert twin.get("k") == b"v"
    twin.set_timeout(timedelta(seconds=3))
    assert (store.timeout, twin.timeout) == (timedelta(seconds=10), timedelta(seconds=3))


def test_clone_through_torch_prefix_store(store) -> None:
    """torch's C++ PrefixStore.clone() clones the store under it through the bridge."""
    twin = dist.PrefixStore("agent", store).clone()
    twin.set("k", "v")
    assert dist.PrefixStore("agent", store).get("k") == b"v"


def test_extended_api_through_torch_store_paths(store) -> None:
    wrapped = dist.PrefixStore("agent", store)
    assert wrapped.has_extended_api() is True
    wrapped.multi_set(["a", "b"], ["1", b"2"])
    wrapped.append("a", "+")
    assert wrapped.multi_get(["b", "a"]) == [b"2", b"1+"]


# --- the client -------------------------------------------------------------------------


def test_an_etcd_restart_shorter_than_the_budget_is_invisible(etcd, caplog) -> None:
    client = EtcdClient(EtcdOptions.from_params(params(etcd.endpoint, read_timeout=30)))
    etcd.stop()
    restart = threading.Thread(target=etcd.start)
    restart.start()
    with caplog.at_level(logging.WARNING, logger="elastic._agent.rendezvous.etcd_client"):
        assert client.get(b"/nothing") is None
    restart.join()
    assert "reconnected to" in caplog.text
    client.close()


def test_json_shaped_requests_other_callers_send(client) -> None:
    """Deletes of a range and compares over a range, as the rendezvous's reopening sends them."""
    prefix = f"/shape/{uuid.uuid4().hex}/".encode()
    client.txn([], [client.put_op(prefix + b"a", b"1"), client.put_op(prefix + b"b", b"2")], [], what="write")
    none_below = {"key": encode(prefix + b"x/"), "range_end": encode(prefix_end(prefix + b"x/")),
                  "result": "EQUAL", "target": "CREATE", "create_revision": 0}
    delete = {"request_delete_range": {"key": encode(prefix), "range_end": encode(prefix_end(prefix))}}
    reply = client.txn([none_below], [delete], [], what="delete")
    assert reply["succeeded"] and reply["responses"][0]["response_delete_range"]["deleted"] == "2"
    assert key_values(client.range(prefix, prefix=True)) == []
    reply = client.txn([], [client.range_op(prefix + b"a")], [], what="read")
    assert txn_range_results(reply) == [[]]


def test_unusable_tls_files_fail_in_one_line(tmp_path) -> None:
    tls = make_tls(tmp_path / "pki")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    endpoint = f"127.0.0.1:{free_port()}"  # never dialled: the files are read first
    cases = [
        ({"ca_cert": str(garbage)}, "ca_cert .*garbage.pem is unusable"),
        ({"ca_cert": str(tls.ca), "ssl_cert": str(tls.client_cert), "ssl_cert_key": str(tls.server_key)},
         "ssl_cert/ssl_cert_key .* is unusable"),
    ]
    for conf, message in cases:
        with pytest.raises(RendezvousConnectionError, match=message) as info:
            EtcdClient(EtcdOptions.from_params(params(endpoint, protocol="https", **conf)))
        assert "\n" not in str(info.value)


@pytest.fixture
def tls_etcd(tmp_path):
    """An etcd of this test's own on TLS with client certificates: credentials need https."""
    server = EtcdServer(tmp_path / "etcd-data", tls=make_tls(tmp_path / "pki"))
    server.start()
    yield server
    server.stop()


def test_a_wrong_password_is_one_line(tls_etcd, tmp_path) -> None:
    tls_etcd.enable_auth(root_password="pw")
    with pytest.raises(RendezvousConnectionError) as info:
        create_backend(params(tls_etcd.endpoint, read_timeout=5, **login_conf(tls_etcd.tls, "wrong", tmp_path)))
    assert str(info.value) == (
        f"etcd at {tls_etcd.endpoint} rejected user 'root': etcdserver: authentication failed, invalid user ID or password"
    )


def test_an_expired_token_is_renewed_for_a_waiting_store(tls_etcd, tmp_path) -> None:
    tls_etcd.enable_auth(root_password="pw")
    _, store = create_backend(params(tls_etcd.endpoint, read_timeout=20, **login_conf(tls_etcd.tls, "pw", tmp_path)))
    # As after an etcd restart (simple tokens do not survive one), just as the wait starts watching.
    before_the_watch(store, lambda: setattr(store._client, "_token", "stale"))
    timer = threading.Timer(0.3, store.clone().set, ("k", "v"))
    timer.start()
    assert store.get("k") == b"v"
    timer.join()


def test_latency_benchmark_prints_both_clients_and_their_ratio(shared_etcd) -> None:
    done = warm.run(
        [sys.executable, "benchmarks/etcd_latency.py", "--endpoint", shared_etcd.endpoint, "--calls", "5", "--warmup", "1"],
        timeout=120, cwd=REPO, env=worker_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for request in ("get", "put", "txn"):
        assert re.search(rf"^{request} +gRPC \(EtcdClient, pyetcd\) +[\d.]+ +[\d.]+$", done.stdout, re.MULTILINE), done.stdout
        assert re.search(rf"^{request} +JSON gateway \(etcd3gw\) +[\d.]+ +[\d.]+$", done.stdout, re.MULTILINE), done.stdout
        assert re.search(rf"^{request} +ratio gateway/gRPC +[\d.]+x +[\d.]+x$", done.stdout, re.MULTILINE), done.stdout
