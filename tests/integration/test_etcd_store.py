"""EtcdStore behaves as TCPStore does: every check runs against both, side by side."""

from __future__ import annotations

import re
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic._agent.rendezvous.etcd import create_backend
from elastic._agent.rendezvous.etcd_store import EtcdStore

TIMEOUT = timedelta(seconds=1)


@pytest.fixture(scope="module")
def tcp_server():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)
    yield server


def etcd_store(endpoint: str, run_id: str) -> dist.Store:
    params = RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1)
    _, store = create_backend(params)
    store.set_timeout(TIMEOUT)
    return store


@pytest.fixture(params=["tcp", "etcd"])
def make_store(request, tcp_server, shared_etcd):
    """A factory of clients of one fresh store: several clients see the same keys."""
    namespace = uuid.uuid4().hex
    if request.param == "tcp":
        def make() -> dist.Store:
            client = dist.TCPStore("127.0.0.1", tcp_server.port, 1, False, timeout=TIMEOUT)
            return dist.PrefixStore(namespace, client)
    else:
        keep_alive = []  # the Python object must outlive its C++ wrapper, as the agent's handler keeps it

        def make() -> dist.Store:
            # Wrapped as the agent wraps it: calls cross torch's C++ bridge.
            keep_alive.append(etcd_store(shared_etcd.endpoint, namespace))
            return dist.PrefixStore("agent", keep_alive[-1])
    return make


@pytest.fixture
def store(make_store):
    return make_store()


def test_set_then_get_returns_bytes(store) -> None:
    store.set("key", "value")
    assert store.get("key") == b"value"
    store.set("binary", b"\x00\xff\x01")
    assert store.get("binary") == b"\x00\xff\x01"
    store.set("key", "replaced")
    assert store.get("key") == b"replaced"


def waited_ms(error: pytest.ExceptionInfo[dist.DistStoreError]) -> int:
    """How long the store says it waited (its own count, in TCPStore's words)."""
    return int(re.search(r"wait timeout after (\d+)ms", str(error.value)).group(1))


def test_get_of_a_missing_key_times_out_with_dist_store_error(store) -> None:
    assert store.timeout == timedelta(seconds=1)  # the fixture's read_timeout, not c10d's default 300 s
    with pytest.raises(dist.DistStoreError, match="timeout") as error:
        store.get("never")
    assert waited_ms(error) >= 900, error.value


def test_get_blocks_until_another_client_sets_the_key(make_store) -> None:
    reader, writer = make_store(), make_store()
    reader.set_timeout(timedelta(seconds=10))
    threading.Timer(0.3, writer.set, ("late", "arrived")).start()
    assert reader.get("late") == b"arrived"


def test_add_creates_at_zero_and_returns_the_new_value(store) -> None:
    assert store.add("counter", 3) == 3
    assert store.add("counter", -5) == -2
    assert store.add("zero", 0) == 0
    assert store.get("zero") == b"0"
    store.set("text", "7")
    assert store.add("text", 1) == 8


def test_add_is_atomic_under_concurrent_clients(make_store) -> None:
    clients = [make_store() for _ in range(4)]
    per_client = 15

    def hammer(client: dist.Store) -> None:
        for _ in range(per_client):
            client.add("shared", 1)

    threads = [threading.Thread(target=hammer, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert clients[0].add("shared", 0) == len(clients) * per_client


def test_compare_set(store) -> None:
    assert store.compare_set("absent", "", "created") == b"created"
    assert store.compare_set("missing", "expected", "desired") == b"expected"
    assert not store.check(["missing"])
    assert store.compare_set("absent", "created", "swapped") == b"swapped"
    assert store.compare_set("absent", "wrong", "ignored") == b"swapped"
    assert store.get("absent") == b"swapped"


def test_wait_returns_when_keys_exist_and_times_out_otherwise(store) -> None:
    store.set("a", "1")
    store.wait(["a"])
    with pytest.raises(dist.DistStoreError, match="timeout") as error:
        store.wait(["a", "b"], timedelta(milliseconds=300))
    assert waited_ms(error) >= 250, error.value  # the given 300 ms, not the store's 1 s: see the next wait
    with pytest.raises(dist.DistStoreError):
        store.wait(["b"])  # the store's own timeout


def test_check_does_not_wait(store, monkeypatch: pytest.MonkeyPatch) -> None:
    store.set("a", "1")
    store.set_timeout(timedelta(seconds=120))
    # A check reads once: ours never watches for keys nor sleeps to retry (TCPStore's check is torch's own).
    monkeypatch.setattr(EtcdStore, "_watch_until_present", lambda *args: pytest.fail("check() waited for keys"))
    monkeypatch.setattr(time, "sleep", lambda seconds: pytest.fail("check() slept"))
    assert store.check(["a"]) is True
    assert store.check(["a", "b"]) is False
    assert store.check([]) is True


def test_delete_key_says_whether_a_key_was_removed(store) -> None:
    store.set("a", "1")
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert not store.check(["a"])


def test_num_keys_counts_sets_and_deletes(store) -> None:
    before = store.num_keys()
    store.set("one", "1")
    store.set("two", "2")
    assert store.num_keys() == before + 2
    store.delete_key("one")
    assert store.num_keys() == before + 1


def test_append_creates_then_extends(store) -> None:
    store.append("log", "ab")
    store.append("log", b"cd")
    assert store.get("log") == b"abcd"


def test_multi_set_and_multi_get(store) -> None:
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.multi_get(["x", "never"])


def test_prefix_store_over_the_store_keeps_namespaces_apart(make_store) -> None:
    base = make_store()
    first, second = dist.PrefixStore("first", base), dist.PrefixStore("second", base)
    first.set("k", "1")
    second.set("k", "2")
    assert (first.get("k"), second.get("k")) == (b"1", b"2")
    assert first.add("n", 2) == 2 and second.add("n", 5) == 5
    assert first.multi_get(["k", "n"]) == [b"1", b"2"]


def test_etcd_add_counts_once_when_a_reply_is_lost(shared_etcd) -> None:
    """A transaction applied by etcd whose reply never arrived is retried by the
    client; the retry must not add twice."""
    store = etcd_store(shared_etcd.endpoint, uuid.uuid4().hex)
    client = store._client
    real_txn = client.txn
    lost = []

    def txn_losing_first_reply(*args, **kwargs):
        reply = real_txn(*args, **kwargs)
        if not lost and reply.get("succeeded"):
            lost.append(reply)
            return real_txn(*args, **kwargs)  # the client's retry of the same request
        return reply

    client.txn = txn_losing_first_reply
    assert store.add("counter", 5) == 5
    assert lost, "the test did not replay a transaction"
    assert store.add("counter", 0) == 5


def test_compare_set_with_an_empty_expectation_matches_an_empty_value(store) -> None:
    store.set("blank", "")
    assert store.compare_set("blank", "", "filled") == b"filled"
    assert store.get("blank") == b"filled"


def test_more_keys_than_one_etcd_transaction_takes(store) -> None:
    keys = [f"node{i}" for i in range(300)]  # etcd's --max-txn-ops is 128
    store.multi_set(keys, [str(i) for i in range(300)])
    assert store.multi_get(keys) == [str(i).encode() for i in range(300)]
    assert store.check(keys)
    store.wait(keys, timedelta(seconds=5))


def test_wait_while_etcd_is_down_times_out_as_a_wait(etcd) -> None:
    params = RendezvousParameters(backend="etcd-v3", endpoint=etcd.endpoint, run_id=uuid.uuid4().hex, min_nodes=1,
                                  max_nodes=1, read_timeout="1")
    _, store = create_backend(params)
    etcd.stop()
    with pytest.raises(dist.DistStoreError, match="timeout") as error:
        store.wait(["never"], timedelta(milliseconds=200))
    # The wait's own deadline ended it (with what went wrong), not the client's retries giving up.
    assert "etcd store; " in str(error.value) and waited_ms(error) >= 150, error.value


def test_clone_is_a_store_on_the_same_keys(store) -> None:
    twin = store.clone()
    assert isinstance(twin, dist.Store)
    store.set("k", "v")
    assert twin.get("k") == b"v"
    twin.set("back", "1")
    assert store.get("back") == b"1"


def test_extended_api_is_on_so_torch_uses_append_and_multi_ops(store) -> None:
    assert store.has_extended_api() is True
    store.multi_set(["a", "b"], ["1", "2"])
    store.append("a", "0")
    assert store.multi_get(["a", "b"]) == [b"10", b"2"]
