"""The rendezvous state torch pickles, as a stranger may write it: the restricted unpickler, the
job's signature, the launch in every seal, the guard on the backend's path (torch's own state holder
over an in-process store), and the Slurm store's port taken before a squatter's."""

from __future__ import annotations

import base64
import os
import pickle
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from elastic._agent.launcher.slurm_launch import hold_store_port
from elastic._agent.rendezvous.guarded_c10d import C10dStateBackend
from elastic._agent.rendezvous.held_port import holder_uid
from elastic._agent.rendezvous.quick_rounds import DEPARTED, LAST_ROUND
from elastic._agent.rendezvous.state_guard import StateGuard
from elastic._agent.rendezvous.state_pickle import StateRefused, check_state
from elastic._agent.rendezvous.state_seal import StateSeal
from elastic._shared.common.errors import UsageError
from elastic._shared.storage.peer_auth import PeerKey

RUN = "slurm-1234"
KEY = PeerKey(b"k" * 32)
LAUNCH, EARLIER = "a" * 32, "e" * 32


class Marker:
    """A payload whose unpickling creates a file: what a stranger writes to run code in an agent."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (str(self.path),))


def genuine_state() -> _RendezvousState:
    state = _RendezvousState()
    node, other = _NodeDesc("n1", 10, 0), _NodeDesc("n2", 11, 0)
    now = datetime.now(timezone.utc)
    state.round, state.complete, state.deadline = 3, True, now + timedelta(seconds=5)
    state.participants = {node: 0, other: 1}
    state.wait_list, state.redundancy_list = {_NodeDesc("n3", 12, 1)}, set()
    state.last_heartbeats = {node: now, other: now}
    setattr(state, LAST_ROUND, (2, frozenset({node, other})))
    setattr(state, DEPARTED, frozenset())
    return state


def test_a_genuine_torch_state_round_trips_through_the_restricted_unpickler_and_the_seal() -> None:
    state = genuine_state()
    payload = pickle.dumps(state)
    assert vars(check_state(payload)) == vars(state)
    seal = StateSeal(RUN, KEY)
    opened = seal.open(seal.seal(payload, 7, LAUNCH))
    assert (opened.launch, opened.seq, opened.payload) == (LAUNCH, 7, payload)
    bare = StateSeal(RUN, None).open(payload)  # no secret: torch's bare pickle
    assert (bare.launch, bare.seq, bare.payload) == (None, 0, payload)


def test_a_pickled_marker_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps(Marker(marker))
    for blob in (payload, StateSeal(RUN, KEY).seal(payload, 1, LAUNCH)):  # even signed with the job's own secret
        for seal in (StateSeal(RUN, None), StateSeal(RUN, KEY)):
            with pytest.raises(StateRefused):
                seal.open(blob)
    with pytest.raises(StateRefused, match="posix.mkdir"):
        check_state(payload)
    assert not marker.exists()


@pytest.mark.parametrize("what", ["other class", "wrong type", "naive time", "extra field", "not a pickle", "huge"])
def test_states_torch_could_load_but_not_use_are_refused(what: str) -> None:
    state = genuine_state()
    if what == "other class":
        payload = pickle.dumps({"round": 1})
    elif what == "wrong type":
        state.round = "3"
        payload = pickle.dumps(state)
    elif what == "naive time":
        state.last_heartbeats = {_NodeDesc("n1", 1, 0): datetime.now()}
        payload = pickle.dumps(state)
    elif what == "extra field":
        state.command = "rm -rf /"
        payload = pickle.dumps(state)
    elif what == "not a pickle":
        payload = b"\x80\x04garbage"
    else:
        payload = b"x" * (5 << 20)
    with pytest.raises(StateRefused):
        check_state(payload)


def test_only_a_state_signed_with_the_jobs_secret_for_this_run_is_opened() -> None:
    payload = pickle.dumps(genuine_state())
    signed = StateSeal(RUN, KEY).seal(payload, 2, LAUNCH)
    refusals = {
        "another secret": StateSeal(RUN, PeerKey(b"z" * 32)).seal(payload, 2, LAUNCH),
        "another run": StateSeal("slurm-9", KEY).seal(payload, 2, LAUNCH),
        "unsigned": payload,
        "payload changed": signed[:-1] + bytes([signed[-1] ^ 1]),
        "number changed": signed.replace(b" 2 ", b" 9 ", 1),
        "launch changed": signed.replace(LAUNCH.encode(), EARLIER.encode(), 1),
        "garbage line": b"torchrevive-rdzv-signed/2 x\n" + payload,
    }
    for what, blob in refusals.items():
        with pytest.raises(StateRefused):
            StateSeal(RUN, KEY).open(blob)
            pytest.fail(what)


def test_a_value_that_merely_looks_signed_never_stops_an_unsigned_agent() -> None:
    """Probe (issue 55, M): a value starting with the signed-state magic ended an unsigned job with exit 2,
    which deploy/slurm and deploy/k8s treat as final. It is refused like any stranger's value now."""
    lines: list[str] = []
    guard = StateGuard(StateSeal(RUN, None), warn=lines.append)
    for blob in (b"torchrevive-rdzv-signed/2 anything\n", StateSeal(RUN, KEY).seal(pickle.dumps(genuine_state()), 1, LAUNCH)):
        assert pickle.loads(guard.admit(blob)).round == 0  # a fresh state: the next write replaces the value
    assert guard.refused == 2 and "signed with a secret and this agent has none" in lines[0]


def holder(backend) -> _BackendRendezvousStateHolder:
    settings = RendezvousSettings(RUN, 1, 2, RendezvousTimeout(), timedelta(seconds=1), 3)
    return _BackendRendezvousStateHolder(backend, settings, cache_duration=0)


def forge(store: dist.Store, key: str, payload: bytes) -> None:
    """Write `payload` at `key` as torch's own c10d backend stores a state (base64), over whatever is there."""
    store.set(key, base64.b64encode(payload))


@pytest.mark.parametrize("key", [KEY, None], ids=["signed", "no secret"])
def test_a_marker_written_as_torchs_backend_writes_it_is_refused_once_and_then_replaced(
    tmp_path: Path, key: PeerKey | None
) -> None:
    """Written at the key the state lies at: torch's own without a secret; with one, the key the secret
    names (a stranger who recorded an earlier launch's traffic knows it)."""
    store, lines = dist.HashStore(), []
    guard = StateGuard(StateSeal(RUN, key), warn=lines.append)
    backend = C10dStateBackend(store, RUN, guard)
    assert (backend.key == f"torch.rendezvous.{RUN}") is (key is None)
    agent = holder(backend)
    agent.state.round = 4
    agent.mark_dirty()
    assert agent.sync() is True

    marker = tmp_path / "ran"
    forge(store, backend.key, pickle.dumps(Marker(marker)))
    for _ in range(3):
        agent.sync()  # torch's own state holder: it unpickles what the backend hands it
        assert agent.state.round == 4  # the last state it verified, not a fresh one
    assert not marker.exists()
    assert guard.refused == 3 and len(lines) == 1 and "never unpickled" in lines[0]

    agent.mark_dirty()
    assert agent.sync() is True  # the next write replaces the stranger's value
    assert holder(C10dStateBackend(store, RUN, StateGuard.for_run(RUN, key))).sync() is None
    store.set(backend.key, b"\xff not base64")  # torch's backend would raise: refused the same way
    agent.sync()
    assert agent.state.round == 4 and len(lines) == 2
    assert not marker.exists()


def test_a_stranger_writing_torchs_key_between_any_two_syncs_never_hides_one_agent_from_another(tmp_path: Path) -> None:
    """Probe (issue 55, DoS): a stranger overwrote torch's state key every 0.2 s; the agents of a 2:2 signed
    job read its forgery far more often than each other's writes, each went on from its own last state, and
    neither saw the other join (both timed out). A signed job's state lies at a key the secret names: what a
    stranger writes at torch's key is never read."""
    store, lines = dist.HashStore(), []
    a = holder(C10dStateBackend(store, RUN, StateGuard(StateSeal(RUN, KEY), warn=lines.append)))
    b = holder(C10dStateBackend(store, RUN, StateGuard(StateSeal(RUN, KEY), warn=lines.append)))
    marker = tmp_path / "ran"
    a.state.last_heartbeats = {_NodeDesc("n1", 1, 0): datetime.now(timezone.utc)}  # a live launch: b takes it
    for round_ in range(1, 4):
        a.state.round = round_
        a.mark_dirty()
        assert a.sync() is True
        forge(store, f"torch.rendezvous.{RUN}", pickle.dumps(Marker(marker)))
        b.sync()
        assert b.state.round == round_
    assert not lines and not marker.exists()


def test_a_closing_state_recorded_from_an_earlier_launch_never_closes_the_next_one() -> None:
    """Probe (issue 55, M): a closing state of an earlier launch of the same run id and secret, written into
    the next launch's store, was accepted and closed it. A state of a launch an agent has not met must be
    live to be taken: one with no heartbeat younger than torch's dead-node time is an earlier launch's."""
    store, lines = dist.HashStore(), []
    closed, stale = genuine_state(), genuine_state()
    closed.closed = True
    for recorded in (closed, stale):  # recorded a minute before the next launch starts
        recorded.last_heartbeats = {n: datetime.now(timezone.utc) - timedelta(seconds=60) for n in recorded.participants}
    for recorded in (closed, stale):
        blob = StateSeal(RUN, KEY).seal(pickle.dumps(recorded), 99, EARLIER)
        forge(store, StateSeal(RUN, KEY).store_key(), blob)
        guard = StateGuard(StateSeal(RUN, KEY), warn=lines.append, live_within=3)
        agent = holder(C10dStateBackend(store, RUN, guard))
        agent.sync()
        assert not agent.state.closed and agent.state.round == 0  # never adopted: a fresh state
        agent.mark_dirty()
        assert agent.sync() is True  # its first write replaces the recorded state, under a launch of its own
        guard.fix()
        assert guard.launch not in (None, EARLIER)
    assert len(lines) == 2 and all("no node of it sent a heartbeat in the last 3 s" in line for line in lines)


def test_agents_of_a_launch_agree_on_it_and_a_fixed_launch_refuses_every_other() -> None:
    store, lines = dist.HashStore(), []
    first = StateGuard(StateSeal(RUN, KEY), warn=lines.append)
    second = StateGuard(StateSeal(RUN, KEY), warn=lines.append)
    a, b = holder(C10dStateBackend(store, RUN, first)), holder(C10dStateBackend(store, RUN, second))
    a.state.last_heartbeats = {_NodeDesc("n1", 1, 0): datetime.now(timezone.utc)}
    a.mark_dirty()
    assert a.sync() is True
    b.sync()  # a live state of a launch the second agent has not met: it takes it (its own draft was never written)
    assert first.current_launch == second.current_launch and not lines
    first.fix()
    second.fix()
    other = genuine_state()
    forge(store, StateSeal(RUN, KEY).store_key(), StateSeal(RUN, KEY).seal(pickle.dumps(other), 50, EARLIER))
    a.sync()
    assert a.state.round == 0 and "belongs to another launch" in lines[0]  # live, signed, but not this launch's


def test_a_forged_wait_list_never_reaches_torch_in_a_signed_job() -> None:
    """Probe (issue 55, L): a wait list a stranger wrote into an unsigned job's state stalled it (every agent
    restarted its workers for a node that never came). A job signs by default; what it does not sign is
    never its state."""
    store, lines = dist.HashStore(), []
    agent = holder(C10dStateBackend(store, RUN, StateGuard(StateSeal(RUN, KEY), warn=lines.append)))
    agent.mark_dirty()
    assert agent.sync() is True
    forged = genuine_state()
    forged.wait_list = {_NodeDesc("10.9.9.9", 1, 0)}
    forge(store, StateSeal(RUN, KEY).store_key(), pickle.dumps(forged))
    agent.sync()
    assert agent.state.wait_list == set() and len(lines) == 1


def test_a_signed_state_written_back_later_is_refused_as_a_replay() -> None:
    store, lines = dist.HashStore(), []
    agent = holder(C10dStateBackend(store, RUN, StateGuard(StateSeal(RUN, KEY), warn=lines.append)))
    agent.state.round = 1
    agent.mark_dirty()
    agent.sync()
    recorded = store.get(StateSeal(RUN, KEY).store_key())  # anyone who can name the key can read it
    agent.state.round = 2
    agent.mark_dirty()
    agent.sync()
    store.set(StateSeal(RUN, KEY).store_key(), recorded)
    agent.sync()
    assert agent.state.round == 2 and "older than write 2" in lines[0]


def test_the_slurm_store_port_held_by_another_socket_is_refused_in_one_line() -> None:
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # bound, as a squatter's server first is
    squatter.bind(("0.0.0.0", 0))
    try:
        with pytest.raises(UsageError, match=r"port \d+ on this node.*already taken by") as refused:
            hold_store_port(squatter.getsockname()[1])
    finally:
        squatter.close()
    assert "\n" not in str(refused.value)


def test_the_ports_holder_is_read_from_proc_net_defensively(tmp_path: Path) -> None:
    table = tmp_path / "tcp"
    table.write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 00000000:5208 00000000:0000 0A 00000000:00000000 00:00000000 00000000  4242        0 1\n"
        "   1: 0100007F:5209 0100007F:9999 01 00000000:00000000 00:00000000 00000000  1000        0 2\n"
        "   2: garbage\n"
        "   3: 00000000:ZZZZ 00000000:0000 0A 00000000:00000000 00:00000000 00000000  7 0 3\n"
    )
    assert holder_uid(0x5208, [str(table), str(tmp_path / "missing")]) == 4242
    assert holder_uid(0x5209, [str(table)]) is None  # an established connection holds no port
