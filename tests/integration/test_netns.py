"""Virtual hosts for the chaos harness: namespaces that reach each other and this
machine, until a cable is cut."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.chaos.netns import NetworkUnavailable, VirtualNetwork

# Connects to HOST:PORT from inside a host; prints "ok" or the error's name.
DIAL = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close()
    print("ok")
except OSError as exc:
    print(type(exc).__name__)
"""


def dial(net: VirtualNetwork, host: int, address: str, port: int) -> str:
    done = subprocess.run(net.wrap(host, [sys.executable, "-c", DIAL, address, str(port)]),
                          capture_output=True, text=True, timeout=30)
    return done.stdout.strip() or done.stderr


def test_hosts_reach_each_other_and_this_machine_until_a_link_is_cut(network: VirtualNetwork) -> None:
    first, second = network.add_host(), network.add_host()
    assert (first, second) == (network.address(0), network.address(1))
    listener = subprocess.Popen(
        network.wrap(0, [sys.executable, "-c", "import socket,time; s=socket.create_server(('0.0.0.0', 7777)); time.sleep(60)"]),
    )
    here = socket.create_server((network.gateway, 0))
    try:
        deadline = time.monotonic() + 20
        while dial(network, 1, first, 7777) != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dial(network, 1, first, 7777) == "ok"
        assert dial(network, 1, network.gateway, here.getsockname()[1]) == "ok", "hosts reach this machine at the gateway"
        network.cut(0)
        assert dial(network, 1, first, 7777) == "TimeoutError", "a cut link drops packets: no reset, a stall"
        network.heal(0)
        assert dial(network, 1, first, 7777) == "ok"
    finally:
        here.close()
        listener.kill()
        listener.wait()


def test_close_kills_what_runs_inside_and_removes_every_namespace(network: VirtualNetwork) -> None:
    network.add_host()
    names = [network.namespace(0)]
    inside = subprocess.Popen(network.wrap(0, [sys.executable, "-c", "import time; time.sleep(60)"]))
    time.sleep(0.5)
    network.close()
    assert inside.wait(10) == -9, "a process left inside a namespace would keep it alive"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names) and network.id not in listed


def test_a_network_whose_creator_died_is_swept_by_the_next_one() -> None:
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    leftover = f"trv-{dead.pid}-abcdef-sw"
    if subprocess.run(["ip", "netns", "add", leftover], capture_output=True).returncode != 0:
        pytest.skip("no network namespaces here")
    try:
        with VirtualNetwork.create():
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert leftover not in listed
    finally:
        subprocess.run(["ip", "netns", "del", leftover], capture_output=True)


def test_without_root_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(NetworkUnavailable, match="need root"):
        VirtualNetwork.create()


def test_the_chaos_cli_refuses_partition_on_loopback(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "elastic.chaos", "--scenario", "partition", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "python -m elastic.chaos: error: --scenario partition cuts a host's link: it needs --hosts netns\n"


def test_loopback_etcd_endpoints_are_rewritten_to_the_gateway_hosts_see() -> None:
    from elastic.chaos.__main__ import as_seen_from_hosts

    assert as_seen_from_hosts("127.0.0.1:2379", "10.9.9.254") == "10.9.9.254:2379"
    assert as_seen_from_hosts("http://localhost:2379,10.0.0.5:2379,https://127.0.0.1:2380", "G") == (
        "http://G:2379,10.0.0.5:2379,https://G:2380"
    )
