"""The round handshake on torchrun's shared agent store, against a real TCPStore:
each rank a thread with a client of its own, as each worker is a process."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from elastic._worker.runtime.context import log_recovery_hint
from elastic._worker.runtime.round_store import (
    HELLOS,
    PREFIX,
    RoundStoreError,
    agree_on_round,
    await_store_server,
    recovery_hint,
    round_store,
)

TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def server() -> dist.TCPStore:
    """The agent's store: one server for every round of the job."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def client(server: dist.TCPStore, timeout: timedelta = TIMEOUT) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=timeout)


def run_ranks(world_size: int, work: Callable[[int], object], delays: dict[int, float] | None = None) -> list:
    """`work(rank)` for every rank on threads of its own (rank r starts after delays[r] s);
    returns each rank's result or the exception it raised."""
    results: list = [None] * world_size

    def run(rank: int) -> None:
        time.sleep((delays or {}).get(rank, 0.0))
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def handshake(server: dist.TCPStore, world_size: int, delays: dict[int, float] | None = None) -> list[dist.Store]:
    stores = run_ranks(
        world_size, lambda rank: agree_on_round(client(server), rank=rank, world_size=world_size, timeout=TIMEOUT), delays
    )
    errors = [s for s in stores if isinstance(s, BaseException)]
    assert not errors, errors
    return stores


def same_namespace(stores: list[dist.Store], probe: str) -> bool:
    """A key rank 0 writes through its store is visible to every rank through theirs."""
    stores[0].set(probe, "here")
    return all(s.check([probe]) for s in stores)


def test_every_rank_of_a_round_builds_on_one_namespace_and_the_next_round_on_another(server) -> None:
    first = handshake(server, 4)
    assert same_namespace(first, "first-round-key")
    second = handshake(server, 4)
    assert same_namespace(second, "second-round-key")
    assert not second[2].check(["first-round-key"]), "a round read a key of the round before"


def test_a_late_rank_0_still_answers_every_rank(server) -> None:
    stores = handshake(server, 3, delays={0: 0.5})
    assert same_namespace(stores, "probe")


def test_stale_keys_of_a_dead_round_are_never_read(server) -> None:
    # A round that died in the middle: its process group's keys, hellos nobody
    # answered, a reply and a join count of its own are all still in the store.
    dead = handshake(server, 2)
    dead[0].set("0/rank_1", "address of a dead worker")
    raw = client(server)
    raw.append(HELLOS, "1:0123456789abcdef;2:fedcba9876543210;")
    raw.set(f"{PREFIX}reply/0123456789abcdef", "deadbeef")
    raw.add(f"{PREFIX}joined/deadbeef", 5)

    # The new round's rank 1 starts first, when only the dead round's keys are there.
    new = handshake(server, 2, delays={0: 0.5})
    assert same_namespace(new, "new-round-key")
    assert not new[1].check(["0/rank_1"]), "the new round sees the dead round's gloo address"
    assert not dead[1].check(["new-round-key"])


def test_the_handshake_leaves_only_the_process_group_keys_behind(server) -> None:
    raw = client(server)
    raw.append(HELLOS, "1:0000aaaa;")  # left by a dead round
    keys_before = raw.num_keys()
    handshake(server, 3)
    assert raw.get(HELLOS) == b"", "hellos answered are cleared"
    assert not raw.check([f"{PREFIX}reply/0000aaaa"]), "replies to stale hellos are deleted too"
    assert raw.num_keys() == keys_before


def dead_rank_0(server: dist.TCPStore, prefix: str) -> None:
    """Leave in the store what a dead round's rank 0 leaves: a process publishes its
    gloo address under `prefix` and is SIGKILLed while it waits for its peer."""
    raw = client(server)
    before = raw.num_keys()
    code = (
        "import datetime, torch.distributed as dist\n"
        f"store = dist.TCPStore('127.0.0.1', {server.port}, is_master=False, wait_for_workers=False)\n"
        f"dist.ProcessGroupGloo(dist.PrefixStore({prefix!r}, store), 0, 2, timeout=datetime.timedelta(seconds=60))\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while raw.num_keys() == before and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.01)
        assert raw.num_keys() > before, "the doomed rank 0 never published its address"
    finally:
        worker.kill()
        worker.wait()


def gloo_sum(store: dist.Store, rank: int, timeout: timedelta = timedelta(seconds=5)) -> float:
    group = dist.ProcessGroupGloo(store, rank, 2, timeout=timeout)
    value = torch.ones(1)
    group.allreduce([value]).wait()
    return value.item()


def test_gloo_over_the_round_store_ignores_a_dead_rounds_addresses(server) -> None:
    """The bug itself: on torch's keys, a rank that starts before its peer reads the
    dead round's address and its process group fails; on the round's namespace,
    it waits for its peer and the group forms."""
    dead_rank_0(server, "default_pg/0/")
    # The control, torch's keys on the shared store: refused, or (when the dead rank was
    # to dial) no one ever connects.
    with pytest.raises(RuntimeError, match="connectFullMesh failed"):
        gloo_sum(dist.PrefixStore("default_pg/0/", client(server)), 1, timeout=timedelta(seconds=1))

    def ours(rank: int) -> float:
        store = agree_on_round(client(server, timedelta(seconds=5)), rank=rank, world_size=2, timeout=TIMEOUT)
        return gloo_sum(store, rank)

    assert run_ranks(2, ours, delays={0: 1.0}) == [2.0, 2.0]  # rank 1 first, as in the control


def test_a_rank_0_that_never_answers_is_one_clear_error(server) -> None:
    with pytest.raises(RoundStoreError) as info:
        agree_on_round(client(server), rank=1, world_size=2, timeout=timedelta(seconds=0.5), where="the test store")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("rank 1: rank 0 of this round never answered within 0:00:00.500000 through the test store")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message and "torchrevive-run" in message


def test_a_rank_0_whose_peers_never_join_is_one_clear_error(server) -> None:
    client(server).append(HELLOS, "1:0123456789abcdef;")  # a stale hello is not a join
    with pytest.raises(RoundStoreError, match=r"^rank 0: 0 of the 2 other ranks joined this round within 0:00:00.5"):
        agree_on_round(client(server), rank=0, world_size=3, timeout=timedelta(seconds=0.5))


def test_a_store_whose_server_is_gone_is_one_clear_error() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = client(server, timedelta(seconds=2))
    del server
    with pytest.raises(RoundStoreError, match=r"^rank 1: torchrun's agent store \(the agent store\) failed"):
        agree_on_round(store, rank=1, world_size=2, timeout=timedelta(seconds=2))


def test_only_torchruns_shared_agent_store_gets_a_round_namespace(server) -> None:
    launched = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "TORCHELASTIC_RUN_ID": "job"}
    for environ in ({}, launched, {**launched, "TORCHELASTIC_USE_AGENT_STORE": "False"}):
        assert round_store(environ, rank=0, world_size=1, timeout=TIMEOUT) is None
    store = round_store({**launched, "TORCHELASTIC_USE_AGENT_STORE": "True"}, rank=0, world_size=1, timeout=TIMEOUT)
    assert isinstance(store, dist.PrefixStore)
    with pytest.raises(RoundStoreError, match="do not name the agent's store; start workers with torchrun"):
        round_store({"TORCHELASTIC_USE_AGENT_STORE": "True"}, rank=0, world_size=1, timeout=TIMEOUT)


PLAIN_TORCHRUN = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "j7"}
FRESH_STORES = {**PLAIN_TORCHRUN, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
ELASTIC = ["--nnodes=1:3", "--rdzv-backend=c10d", "--rdzv-endpoint=h:29400", "train.py", "--lr", "1"]
FAST_CONF = "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def test_the_hint_leads_plain_torchrun_with_default_settings_to_the_fast_path() -> None:
    hint = recovery_hint(PLAIN_TORCHRUN, ELASTIC)
    assert hint is not None and "\n" not in hint and hint.startswith("run j7: under plain torchrun ")
    assert "joins after the first round" in hint and "30 s last call" in hint
    assert hint.endswith(f"use torchrevive-run (python -m elastic._agent.launcher, same flags), or "
                         f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun {FAST_CONF}")
    assert "hang" not in hint and "stale" not in hint, "stale addresses are no longer a reason"


@pytest.mark.parametrize(
    ("environ", "argv", "says", "fix"),
    [
        # A store per round, torch's last call: only the last call is left.
        (FRESH_STORES, ELASTIC, "every recovery waits", f"or torchrun {FAST_CONF}"),
        # The last call shortened, the store shared: only late joins are left.
        (PLAIN_TORCHRUN, ["--rdzv-conf=last_call_timeout=2", *ELASTIC], "joins after the first round",
         "or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun"),
        # MIN = MAX: no last call, but a replaced node still joins late.
        (PLAIN_TORCHRUN, ["--nnodes=2", "--rdzv-backend=c10d", "train.py"], "joins after the first round",
         "or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun"),
    ],
)
def test_the_hint_names_only_what_applies(environ: dict[str, str], argv: list[str], says: str, fix: str) -> None:
    hint = recovery_hint(environ, argv)
    assert hint is not None and says in hint and hint.endswith(fix)
    assert hint.count(";") == 1, "one reason or two, then one fix"


@pytest.mark.parametrize(
    ("environ", "argv"),
    [
        ({**PLAIN_TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": "0"}, ELASTIC),  # never recovers
        (FRESH_STORES, ["--rdzv-conf=join_timeout=9,last_call_timeout=1", *ELASTIC]),  # tuned torchrun
        (FRESH_STORES, None),  # our launcher: its workers' parent is no torchrun
        ({**PLAIN_TORCHRUN, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, None),  # our launcher, static rendezvous
        (PLAIN_TORCHRUN, ["--nnodes=2", "--master-addr=h", "train.py"]),  # static: no late joins, no last call
        (FRESH_STORES, ["--standalone", "--nproc-per-node=2", "train.py"]),
    ],
)
def test_no_hint_where_nothing_is_lost(environ: dict[str, str], argv: list[str] | None) -> None:
    assert recovery_hint(environ, argv) is None


def test_the_scripts_own_arguments_are_not_torchruns() -> None:
    assert "30 s last call" in recovery_hint(FRESH_STORES, [*ELASTIC, "--rdzv-conf=last_call_timeout=1"])


def test_the_runtime_logs_the_hint_in_one_line_and_no_store_warning(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="elastic"):
        log_recovery_hint(FRESH_STORES)  # this test's parent is no torchrun, so it counts as our launcher
        assert not caplog.records
        log_recovery_hint(PLAIN_TORCHRUN)  # told to share the agent store: torchrun, its defaults assumed
    assert len(caplog.records) == 1 and "torchrevive-run" in caplog.text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-conf=" in caplog.text


def test_init_worker_under_the_shared_agent_store_builds_every_group_in_the_round_namespace(server) -> None:
    from elastic._worker.runtime.context import init_worker, shutdown_worker

    environ = {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "job",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    raw = client(server)
    keys_before = raw.num_keys()
    ctx = init_worker("cpu", environ=environ)
    try:
        assert ctx.distributed and dist.get_world_size() == 1
        dist.new_group(backend="gloo")  # as the NCCL path builds its gloo control group: on the default store
        store = dist.distributed_c10d._get_default_store()
        assert isinstance(store, dist.PrefixStore)
        store.set("probe", "x")
        assert not raw.check(["probe"]) and not raw.check(["default_pg/0//cpu/rank_0"])
        assert raw.num_keys() > keys_before, "the groups' keys are in the agent's store, under the round's prefix"
    finally:
        shutdown_worker()


# --- rank 0's store server under a store per round (torchrevive-run) ---------------------


def test_a_rank_waits_for_rank_0s_store_server_before_connecting() -> None:
    """A connect before rank 0 listens is refused, and TCPStore's client retries it only
    after a backoff of about 0.5 s: `await_store_server` returns once the port accepts."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    about_to_listen = threading.Event()

    def listen() -> None:
        about_to_listen.set()  # before listen(): a connect that succeeded came after this
        holder.listen()

    listening = threading.Timer(0.3, listen)
    listening.start()
    try:
        assert await_store_server(environ, deadline=time.monotonic() + 60)
        assert about_to_listen.is_set(), "it returned before the server listened"
    finally:
        listening.join()
        holder.close()


def test_waiting_for_a_store_server_gives_up_at_its_deadline_or_without_an_address() -> None:
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))  # bound, never listening: every connect is refused
    try:
        environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(unused.getsockname()[1])}
        assert not await_store_server(environ, deadline=time.monotonic() + 0.1)
    finally:
        unused.close()
    assert not await_store_server({}, deadline=time.monotonic() + 60)
    assert not await_store_server({"MASTER_ADDR": "h", "MASTER_PORT": "x"}, deadline=time.monotonic() + 60)
