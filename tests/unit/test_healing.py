"""The pieces of a heal in place that need no peer: a void step is undone (learning rate, scheduler,
RNG); agents healing at once raise the round to one generation; a live peer's state header is checked
field by field before anything is used (hypothesis)."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from support import context

from elastic._agent.launcher.in_place import raise_generation
from elastic._shared.protocol import heal_env
from elastic._shared.storage.store_records import Records
from elastic._worker.checkpoint import live_source
from elastic._worker.survivors import regroup
from elastic._worker.survivors.healing import Healing


def healing() -> Healing:
    return Healing(regroup.HealPoint(dist.HashStore(), 0), timeout=timedelta(seconds=1))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_void_step_is_undone_learning_rate_scheduler_and_rng() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    heals = healing()
    torch.manual_seed(3)
    started = heals.before_step(torch.device("cpu"), optimizer, scheduler)
    want_draw = torch.rand(3)
    torch.manual_seed(3)
    torch.rand(5)  # the void step drew from the generator
    scheduler.step()  # and the script stepped its scheduler after the (skipped) optimizer step
    assert optimizer.param_groups[0]["lr"] == 0.5
    heals.undo(started, torch.device("cpu"), optimizer, scheduler)
    assert optimizer.param_groups[0]["lr"] == 1.0 and scheduler.last_epoch == 0
    assert torch.equal(torch.rand(3), want_draw), "the redone step draws what the void one drew"


def test_only_a_ddp_on_gloo_arms_and_counts_itself() -> None:
    heals = healing()
    model = torch.nn.Linear(2, 2)
    assert not heals.arm(context(rank=0), torch.optim.SGD(model.parameters(), lr=0.1))
    assert not heals.ready and heals.point.store.add(heal_env.HEALERS_KEY, 0) == 0


@pytest.mark.parametrize(
    ("current", "failed_in", "want"),
    [(0, [0], 1), (1, [0], 1), (1, [1], 2), (3, [1, 2], 3), (0, [2, 0], 3)],
    ids=["first heal", "a second agent of the same failure", "a failure after a heal",
         "a replacement dead before its group formed", "the newest of several"],
)
def test_a_heal_forms_one_past_the_newest_generation_its_failed_workers_joined(
    current: int, failed_in: list[int], want: int
) -> None:
    assert heal_env.healed_generation(current, failed_in) == want


def test_agents_whose_workers_failed_together_raise_the_round_to_one_generation() -> None:
    store = Records(dist.PrefixStore(heal_env.namespace_prefix("run/0/host:1"), dist.HashStore()), world=4)
    for rank in range(4):
        regroup.count_healer(store, rank=rank, generation=0)
    assert raise_generation(store, [1], started_in=0) == 1
    assert raise_generation(store, [3], started_in=0) == 1, "the same failure: the same generation"
    regroup.count_healer(store, rank=1, generation=1)  # rank 1's replacement joined generation 1, then died
    assert raise_generation(store, [1], started_in=1) == 2
    assert raise_generation(store, [2], started_in=0) == 2, "rank 2 noted generation 0: it failed in the last heal"
    # Rank 1's next replacement, started in generation 2, formed its group there and died before it noted
    # it: the note left is its predecessor's (1), and the heal must still go past 2, not form 2 again.
    assert raise_generation(store, [1], started_in=2) == 3
    assert store.store.add(heal_env.HEALERS_KEY, 0) == 5


def encode(header: object) -> bytes:
    out = io.BytesIO()
    torch.save(header, out)
    return out.getvalue()


def test_a_well_formed_header_is_read_back() -> None:
    header = {"step": 6, "tensors": [["model/weight", [2, 4], "float32"]], "trainer": {}, "extras": {"tag": "ab"}}
    entries, trainer, extras = live_source._check_header(header, 6)
    assert entries == [("model/weight", torch.Size([2, 4]), torch.float32)] and extras == {"tag": "ab"}


@pytest.mark.parametrize(
    "header",
    [
        None, [], {"step": 6}, {"step": 5, "tensors": [], "trainer": {}, "extras": {}},
        {"step": 6, "tensors": [["k", [2], "os.system"]], "trainer": {}, "extras": {}},
        {"step": 6, "tensors": [["k", [-1], "float32"]], "trainer": {}, "extras": {}},
        {"step": 6, "tensors": [["k", "2", "float32"]], "trainer": {}, "extras": {}},
        {"step": 6, "tensors": "all", "trainer": {}, "extras": {}},
        {"step": 6, "tensors": [], "trainer": [], "extras": {}},
    ],
)
def test_a_malformed_header_is_one_line(header: object) -> None:
    with pytest.raises(live_source.LivePeerError) as raised:
        live_source._check_header(header, 6)
    assert "\n" not in str(raised.value) and raised.value.exit_code == heal_env.HEAL_FAILED_EXIT


plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(
    header=st.one_of(
        plain,
        st.fixed_dictionaries({"step": st.integers(), "tensors": plain, "trainer": plain, "extras": plain}),
    )
)
def test_any_header_is_either_read_or_refused_in_one_line(header: object) -> None:
    try:
        live_source._check_header(header, 6)
    except live_source.LivePeerError:
        pass


def test_a_worker_stopped_too_long_is_ended_unless_its_agent_was_stopped_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic._agent.launcher import reaper

    now = [100.0]
    killed: list[int] = []
    monkeypatch.setattr(reaper, "stopped_workers", lambda root: {41: 1})
    monkeypatch.setattr(reaper, "stuck_workers", lambda root: set())
    monkeypatch.setattr(reaper.os, "kill", lambda pid, sig: killed.append(pid))
    watcher = reaper.Reaper(1, frozen_after=3.0, interval=0.25, clock=lambda: now[0])
    for _ in range(11):  # 2.75 s of scans
        watcher.scan()
        now[0] += 0.25
    assert killed == []
    now[0] += 10.0  # a late scan: the agent itself was stopped (a suspended job)
    watcher.scan()
    assert killed == [], "stopped together with its agent: not the worker's fault"
    for _ in range(13):
        now[0] += 0.25
        watcher.scan()
    assert killed == [41]
