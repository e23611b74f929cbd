"""The sealed store (elastic._shared.storage.sealed_store): every value the job reads from a store is
authenticated. A value a stranger writes, or one recorded from another launch, round or key, reads as
absent; counters are parsed by the job, never by the store. In-process stores only (HashStore, reached
through torch's C++ PrefixStore as torch's agent and gloo reach it)."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic._shared.protocol import round_identity, worker_notes
from elastic._shared.protocol.round_identity import RoundIdentity
from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.storage.sealed_store import MAGIC, SealedStore, parse_count, peek

KEY = PeerKey(b"k" * 32)
LAUNCH = "a" * 32


def sealed(inner: dist.Store | None = None, *, key: PeerKey | None = KEY, scope: str = "run one") -> SealedStore:
    store = inner if inner is not None else dist.HashStore()
    store.set_timeout(timedelta(seconds=0.3))
    return SealedStore(store, key, scope)


def test_values_go_in_sealed_and_come_out_whole_through_torchs_prefix_store() -> None:
    store = sealed()
    prefixed = dist.PrefixStore("torch.rendezvous.run.3", store)
    prefixed.set("MASTER_ADDR", "10.0.0.1")
    prefixed.multi_set(["torchelastic/assigned_ranks/0", "torchelastic/assigned_ranks/1"], ["[0, 1]", "[1, 2]"])
    assert store.inner.get("torch.rendezvous.run.3/MASTER_ADDR").startswith(MAGIC)
    assert prefixed.get("MASTER_ADDR") == b"10.0.0.1"
    assert prefixed.multi_get(["torchelastic/assigned_ranks/0", "torchelastic/assigned_ranks/1"]) == [b"[0, 1]", b"[1, 2]"]
    prefixed.wait(["MASTER_ADDR"])
    assert prefixed.check(["MASTER_ADDR"]) and not prefixed.check(["MASTER_PORT"])
    assert prefixed.add("counter", 2) == 2 and prefixed.add("counter", 3) == 5 and prefixed.get("counter") == b"5"
    prefixed.append("list", b"a")
    prefixed.append("list", b"b")
    assert prefixed.get("list") == b"ab"
    assert prefixed.compare_set("cas", "", "one") == b"one"
    assert prefixed.compare_set("cas", "two", "three") == b"one"  # not what is there: unchanged
    assert prefixed.compare_set("cas", "one", "three") == b"three"
    assert prefixed.compare_set("absent", "x", "y") == b"x"  # as TCPStore: a missing key returns `expected`
    assert prefixed.delete_key("cas") and not prefixed.check(["cas"])


def test_a_strangers_value_reads_as_absent_and_a_wait_ends_at_its_timeout_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = sealed()
    ranks = dist.PrefixStore("torch.rendezvous.run.4", store)
    store.inner.set("torch.rendezvous.run.4/torchelastic/assigned_ranks/1", b"[0, 1, 0, 1]")  # the probe
    with caplog.at_level(logging.WARNING):
        assert not ranks.check(["torchelastic/assigned_ranks/1"])
        with pytest.raises(dist.DistStoreError, match="no value sealed"):
            ranks.get("torchelastic/assigned_ranks/1")
        with pytest.raises(dist.DistStoreError):
            ranks.wait(["torchelastic/assigned_ranks/1"], timedelta(seconds=0.2))
    assert len([r for r in caplog.records if "assigned_ranks/1" in r.getMessage()]) == 1
    assert store.refused >= 3


def test_a_read_waiting_on_a_forged_value_takes_the_jobs_value_once_it_is_written() -> None:
    store = sealed()
    store.set_timeout(timedelta(seconds=5))
    store.inner.set("MASTER_PORT", b"1")  # a stranger's, before the job's
    writer = sealed(store.inner)
    threading.Timer(0.1, lambda: writer.set("MASTER_PORT", "29511")).start()
    assert store.get("MASTER_PORT") == b"29511"


def test_a_value_sealed_for_another_launch_round_or_key_is_refused() -> None:
    inner = dist.HashStore()
    first = sealed(inner, scope=round_identity.rendezvous_scope("job", "b" * 32))
    second = sealed(inner, scope=round_identity.rendezvous_scope("job", LAUNCH))
    first.set("torchrevive/notices/job/n1", "crash_loop")  # recorded in the first launch
    assert not second.check(["torchrevive/notices/job/n1"])
    recorded = inner.get("torchrevive/notices/job/n1")
    second.set("n2", "x")
    inner.set("n3", inner.get("n2"))  # moved to another key
    assert not second.check(["n3"])
    rounds = [sealed(inner, scope=round_identity.worker_scope("job", RoundIdentity(LAUNCH, r))) for r in (1, 2)]
    rounds[0].set("hang/verdict", "culprit 1")
    assert not rounds[1].check(["hang/verdict"])  # a hang record of round 1 replayed in round 2
    assert second.open("torchrevive/notices/job/n1", recorded) is None


def test_counters_are_parsed_by_the_job_so_a_forged_count_never_breaks_a_client() -> None:
    for key in (KEY, None):
        store = sealed(key=key)
        store.inner.set("changes", b"x")  # a TCPStore would drop the client's connection on its add
        assert store.add("changes", 0) == 0
        assert store.add("changes", 1) == 1
        store.inner.set("changes", b"99999999999999999999999")  # more than 19 digits: not a count
        assert store.add("changes", 1) == 1
    assert parse_count(b"-3") == -3 and parse_count(b"\xb2") is None and parse_count(b"1_0") is None


def test_without_a_secret_values_carry_no_tag_and_are_read_as_they_are() -> None:
    store = sealed(key=None)
    store.set("k", "v")
    assert store.inner.get("k").endswith(b"v") and peek(store.inner.get("k")) == b"v"
    store.inner.set("k", b"anything")
    assert store.get("k") == b"anything"


def test_concurrent_counts_are_never_lost() -> None:
    """Two writers of the same count (1 -> 2) once both took the store's answer for their own success: a
    sealed value's bytes are each write's own (a nonce), so one of them tries again."""
    inner = dist.HashStore()
    writers = [sealed(inner), sealed(inner)]
    writers[0].add("healers", 1)
    original = writers[1]._probe

    def probe_then_race(key: str) -> bytes | None:
        raw = original(key)
        writers[1]._probe = original  # once: the other writer counts between this one's read and its write
        writers[0].add(key, 1)
        return raw

    writers[1]._probe = probe_then_race
    assert writers[1].add("healers", 1) == 3 and writers[0].add("healers", 0) == 3


def test_nothing_is_written_before_the_scope_is_known_and_nothing_is_read() -> None:
    scope: list[str | None] = [None]
    store = SealedStore(dist.HashStore(), KEY, lambda: scope[0])
    with pytest.raises(dist.DistStoreError, match="before the launch is known"):
        store.set("k", "v")
    scope[0] = "run launch"
    store.set("k", "v")
    scope[0] = None
    assert not store.check(["k"])


def test_the_round_identity_reaches_workers_by_note_first_then_environment(tmp_path) -> None:
    identity = RoundIdentity(LAUNCH, 7)
    env: dict[str, str] = {worker_notes.NOTES_ENV: str(tmp_path)}
    round_identity.publish(identity, env)
    assert env[round_identity.ROUND_ENV] == f"{LAUNCH} 7"
    assert round_identity.read({worker_notes.NOTES_ENV: str(tmp_path), round_identity.ROUND_ENV: f"{LAUNCH} 1"}) == identity
    assert round_identity.read({round_identity.ROUND_ENV: f"{LAUNCH} 3"}) == RoundIdentity(LAUNCH, 3)
    for bad in ("", "A" * 32 + " 1", f"{LAUNCH} -1", f"{LAUNCH} ²", f"{LAUNCH} {1 << 62}", "ab 1"):
        assert round_identity.read({round_identity.ROUND_ENV: bad}) is None
