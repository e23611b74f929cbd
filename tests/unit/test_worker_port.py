"""Each round's worker store port is picked below the kernel's ephemeral range (elastic._agent.rendezvous.worker_port)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from elastic._agent.rendezvous import worker_port


@pytest.mark.parametrize(("text", "start"), [
    ("32768\t60999\n", 32768), ("40000 60999", 40000), ("", 32768), ("abc def", 32768), ("80 60999", 32768),
    ("1 2 3", 32768), ("70000 80000", 32768),
])
def test_the_ephemeral_range_start_is_read_defensively(tmp_path: Path, text: str, start: int) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert worker_port.ephemeral_start(str(path)) == start
    assert worker_port.ephemeral_start(str(tmp_path / "missing")) == worker_port.DEFAULT_EPHEMERAL_START


def test_a_free_port_below_the_range_is_picked_skipping_taken_ones() -> None:
    taken: list[int] = []

    def free(port: int) -> bool:
        if len(taken) < 5:  # the first five drawn are held by someone
            taken.append(port)
            return False
        return True

    port = worker_port.pick(lambda: 1, start=32768, free=free, rng=random.Random(7))
    assert worker_port.LOW <= port < 32768 and port not in taken and len(taken) == 5
    assert all(worker_port.LOW <= p < 32768 for p in taken)


def test_torchs_choice_when_no_port_below_the_range_is_free_or_there_is_none() -> None:
    tried: list[int] = []
    assert worker_port.pick(lambda: 45678, start=32768, free=lambda p: tried.append(p) or False) == 45678
    assert len(tried) == worker_port.ATTEMPTS
    assert worker_port.pick(lambda: 45679, start=worker_port.LOW, free=lambda p: True) == 45679, "no room below"


def test_install_makes_torchs_rendezvous_pick_below_the_range_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous import api

    monkeypatch.setattr(api, "get_free_port", lambda: 50001)
    monkeypatch.setattr(worker_port, "bindable", lambda port: True)
    worker_port.install()
    worker_port.install()  # idempotent: not wrapped twice
    patched = api.get_free_port
    assert patched.below_ephemeral and patched.__closure__ is not None
    assert worker_port.LOW <= api.get_free_port() < worker_port.ephemeral_start()
