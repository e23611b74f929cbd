"""A stranger who reaches a round's worker store writes a rank's address before the rank does (issue 55,
H: the process group's bootstrap keys). With the job's secret the waiting rank never reads it and the group
forms with the real rank; without one (the probe, as torch's own store is) the forged address breaks the
group. Ranks as threads of this process (gloo over loopback), the store as worker_store makes it."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support import free_port, wait_for

from elastic._shared.protocol import round_identity
from elastic._shared.storage.peer_auth import SECRET_FILE_ENV
from elastic._shared.storage.sealed_store import SealedStore
from elastic._worker.runtime.worker_store import worker_store

LAUNCH = "c" * 32


class Recording(SealedStore):
    """The worker's sealed store, noting the keys written through it (to find where rank 1's address goes)."""

    def __init__(self, store: SealedStore) -> None:
        super().__init__(store.inner, store._key, store._scope)
        self.keys: list[str] = []

    def set(self, key: str, value: Any) -> None:
        self.keys.append(key)
        super().set(key, value)


def environ(tmp_path: Path, port: int, *, signed: bool) -> dict[str, str]:
    secret = tmp_path / "secret"
    secret.write_text("q" * 32)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "job",
           round_identity.ROUND_ENV: f"{LAUNCH} 4"}
    if signed:
        env[SECRET_FILE_ENV] = str(secret)
    return env


def form_group_with_a_stranger(tmp_path: Path, *, signed: bool) -> tuple[list[Any], SealedStore]:
    """Rank 0 starts and waits for rank 1's address; a stranger writes one first; then rank 1 starts. The
    ranks' results (the all-reduced tensor, or the error) and rank 0's store."""
    port = free_port()
    stores: list[Any] = [None, None]
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            env = environ(tmp_path, port, signed=signed)
            if not signed:  # the probe against torch's bare store: what gloo reads is what the stranger wrote
                env[round_identity.ROUND_ENV] = ""
            made = worker_store(env, rank=r, world_size=2, timeout=timedelta(seconds=20))
            if made is None:
                made = dist.TCPStore("127.0.0.1", port, None, is_master=r == 0, timeout=timedelta(seconds=20),
                                     wait_for_workers=False)
                made = SealedStore(made, None, "")
            stores[r] = Recording(made)
            group = dist.ProcessGroupGloo(dist.PrefixStore("0", stores[r]), r, 2, timedelta(seconds=8))
            tensor = torch.ones(1)
            group.allreduce([tensor]).wait()
            results[r] = tensor.item()
        except Exception as exc:  # noqa: BLE001 - the result under test
            results[r] = exc

    first = threading.Thread(target=rank, args=(0,), daemon=True)
    first.start()
    keys = wait_for(lambda: stores[0] is not None and stores[0].keys or None, 30, "rank 0's address in the store")
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    rank_1_key = keys[0].removesuffix("/0") + "/1"
    assert stranger.compare_set(rank_1_key, "", b"\x02\x00\x05\x39\x7f\x00\x00\x01") != b""  # the stranger first
    second = threading.Thread(target=rank, args=(1,), daemon=True)
    second.start()
    first.join(40)
    # Unsigned, rank 0's failure is the probe's result; rank 1 then waits for a rank 0 that has given up,
    # until its own timeouts (it held a full suite 40 s). It is waited for no longer than its group's timeout.
    second.join(40 if signed else 10)
    return results, stores[0]


def test_a_strangers_address_in_a_sealed_worker_store_is_never_read_and_the_group_forms(tmp_path: Path) -> None:
    results, store = form_group_with_a_stranger(tmp_path, signed=True)
    assert results == [2.0, 2.0], results
    assert store.refused >= 1  # rank 0 met the stranger's value, and waited for rank 1's own


def test_the_probe_breaks_a_group_on_an_unsealed_store(tmp_path: Path) -> None:
    results, _ = form_group_with_a_stranger(tmp_path, signed=False)
    assert isinstance(results[0], Exception), results  # rank 0 took the stranger's address
