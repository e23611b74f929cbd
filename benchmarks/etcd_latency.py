"""etcd request latency: the rendezvous's gRPC client against etcd3gw's JSON gateway.

    python benchmarks/etcd_latency.py                    # starts a local etcd (Debian: etcd-server)
    python benchmarks/etcd_latency.py --endpoint H:2379  # or measures one that runs
    python benchmarks/etcd_latency.py --calls 1000

Three requests, as the `etcd-v3` rendezvous sends them:

    get   read one key                         (EtcdRendezvousBackend.get_state)
    put   a transaction of one put on a lease  (EtcdStore.set)
    txn   compare the key's mod revision, put on success, read on failure
                                                (EtcdRendezvousBackend.set_state)

through `EtcdClient` (gRPC, `etcd-sdk-python`'s generated stubs, with its
failover, lease and JSON-shaped replies included) and through `etcd3gw`'s client
on etcd's JSON gateway (`/v3/kv/range`, `/v3/kv/txn`: what the rendezvous used
before). The two clients take turns call by call (gRPC, gateway, gRPC, ...), so a
change of machine speed hits both alike. Prints each request's median and p99 in
milliseconds per client, and the gateway/gRPC ratio of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import requests
from etcd3gw.client import Etcd3Client
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic._agent.rendezvous.etcd_client import EtcdClient
from elastic._agent.rendezvous.etcd_messages import (
    encode,
    txn_range_results,
    txn_revision,
)
from elastic._agent.rendezvous.etcd_options import EtcdOptions
from elastic.chaos.etcd import EtcdServer

REQUESTS = ("get", "put", "txn")


def grpc_requests(client: EtcdClient, key: bytes, value: bytes) -> dict[str, Callable[[], object]]:
    """The three requests through the rendezvous's client. Each client has a key of
    its own, so that every compare-and-set after the first succeeds."""
    revision = [0]

    def cas() -> object:
        compare = {"key": encode(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision[0]}
        reply = client.txn([compare], [client.put_op(key, value)], [client.range_op(key)], what="bench")
        revision[0] = txn_revision(reply) if reply["succeeded"] else txn_range_results(reply)[0][0].mod_revision
        return reply

    return {
        "get": lambda: client.get(key, what="bench"),
        "put": lambda: client.txn([], [client.put_op(key, value)], [], what="bench"),
        "txn": cas,
    }


def gateway_requests(client: Etcd3Client, key: bytes, value: bytes, lease: int) -> dict[str, Callable[[], object]]:
    """The same three requests, as the JSON bodies the rendezvous posted to the gateway."""
    revision = [0]
    put = {"request_put": {"key": encode(key), "value": encode(value), "lease": lease}}

    def cas() -> object:
        compare = {"key": encode(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision[0]}
        reply = client.transaction({"compare": [compare], "success": [put],
                                    "failure": [{"request_range": {"key": encode(key)}}]})
        if reply.get("succeeded"):
            revision[0] = int(reply["header"]["revision"])
        else:
            revision[0] = int(reply["responses"][0]["response_range"]["kvs"][0]["mod_revision"])
        return reply

    return {
        "get": lambda: client.post(client.get_url("/kv/range"), json={"key": encode(key)}),
        "put": lambda: client.transaction({"compare": [], "success": [put], "failure": []}),
        "txn": cas,
    }


def measure(calls: int, warmup: int, clients: dict[str, dict[str, Callable[[], object]]]) -> dict[tuple[str, str], list[float]]:
    """Seconds per call of every request of every client; the clients take turns call by call."""
    times: dict[tuple[str, str], list[float]] = {(r, c): [] for r in REQUESTS for c in clients}
    for request in REQUESTS:
        for i in range(warmup + calls):
            for name, ops in clients.items():
                started = time.perf_counter()
                ops[request]()
                elapsed = time.perf_counter() - started
                if i >= warmup:
                    times[(request, name)].append(elapsed)
    return times


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(times: dict[tuple[str, str], list[float]], names: list[str]) -> None:
    grpc_name, gateway_name = names
    print(f"{'request':8}{'client':28}{'median ms':>10}{'p99 ms':>10}")
    for request in REQUESTS:
        for name in names:
            samples = times[(request, name)]
            print(f"{request:8}{name:28}{statistics.median(samples) * 1e3:10.3f}{percentile(samples, 0.99) * 1e3:10.3f}")
        fast, slow = times[(request, grpc_name)], times[(request, gateway_name)]
        print(f"{request:8}{'ratio gateway/gRPC':28}{statistics.median(slow) / statistics.median(fast):9.2f}x"
              f"{percentile(slow, 0.99) / percentile(fast, 0.99):9.2f}x")


def run(endpoint: str, calls: int, warmup: int) -> None:
    options = EtcdOptions.from_params(RendezvousParameters("etcd-v3", endpoint, "bench", 1, 1))
    client = EtcdClient(options)
    host, port = options.endpoints[0].host, options.endpoints[0].port
    session = requests.Session()
    session.trust_env = False  # as the rendezvous's gateway client was: no proxies
    gateway = Etcd3Client(host, port, protocol="http", timeout=5, api_path="/v3/", session=session)
    keys = [f"/bench/{uuid.uuid4().hex}".encode() for _ in range(2)]
    value = b"x" * 600  # about a pickled rendezvous state of a few nodes
    try:
        client.txn([], [client.put_op(k, value) for k in keys], [], what="bench")
        names = ["gRPC (EtcdClient, pyetcd)", "JSON gateway (etcd3gw)"]
        times = measure(calls, warmup, {
            names[0]: grpc_requests(client, keys[0], value),
            names[1]: gateway_requests(gateway, keys[1], value, client.lease_id),
        })
    finally:
        client.close()  # revokes the lease: the benchmark's key goes with it
    print(f"etcd at {endpoint}, {calls} calls per request and client (after {warmup} untimed), taking turns")
    report(times, names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", help="HOST:PORT of a running etcd (default: start a local one)")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per request and client (default 300)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls first (default 30)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.warmup < 0:
        parser.error("--calls must be at least 1 and --warmup not negative")
    if args.endpoint:
        run(args.endpoint, args.calls, args.warmup)
        return 0
    with tempfile.TemporaryDirectory(prefix="etcd-bench-") as directory, EtcdServer(Path(directory) / "data") as server:
        run(server.endpoint, args.calls, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
