"""In-memory snapshots in one process, on a keeper's directory without its server (one node never asks
it anything): buffers made once, a failure at each phase of a write leaving the snapshot before whole,
the state of the step boundary even while the next step runs, and what each snapshot costs."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
from support import wait_for

from elastic._shared.storage import parts
from elastic._shared.storage.chunks import BLOCK, PARALLEL_BYTES, block_checksums, pieces_checksums
from elastic._shared.storage.keeper_address import LOCAL, KeeperAddress
from elastic._worker.checkpoint import CheckpointManager
from elastic._worker.checkpoint.snapshot_costs import SnapshotCosts
from elastic._worker.checkpoint.snapshot_write import COMMITTED, PHASES
from elastic._worker.config import RunConfig
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.events import EventLog, read_events
from elastic._worker.runtime.context import init_worker


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> KeeperAddress:
    """A keeper's directory and the environment its workers find it by, as torchrevive-run sets it."""
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    address = KeeperAddress(root, "http://127.0.0.1:9", "node0", secret)
    for key, value in address.environ().items():
        monkeypatch.setenv(key, value)
    return address


class Faults:
    """A fault hook that fails the snapshot thread at one phase of one step (as if the worker died there:
    nothing of the write after that point runs), or holds it there until `release` is set."""

    def __init__(self, point: str = "", step: int = -1, *, hold: bool = False) -> None:
        self.point, self.step, self.hold = point, step, hold
        self.release = threading.Event()
        self.reached = threading.Event()

    def at(self, point: str, step: int) -> None:
        if (point, step) != (self.point, self.step):
            return
        self.reached.set()
        if self.hold:
            assert self.release.wait(60), "the test never released the snapshot thread"
            return
        raise RuntimeError(f"died at {point} of step {step}")


class Job:
    """A tiny model with a buffer (batch norm), AdamW, a schedule and a sampler; snapshots every step."""

    def __init__(self, tmp_path: Path, *, seed: int = 0, faults: Faults | None = None) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.sampler = ElasticSampler(64, batch_size=4, seed=3)
        self.events = EventLog(tmp_path / "events.jsonl", restart=0)
        self.ckpt = CheckpointManager(
            init_worker("cpu", environ=dict(os.environ)), RunConfig(ckpt_dir=tmp_path / "ckpt", ckpt_every=100, seed=3, snapshot_every=1),
            model=self.model, optimizer=self.optimizer, sampler=self.sampler, scheduler=self.scheduler,
            events=self.events, faults=faults or Faults(),
        )

    def forward_backward(self) -> None:
        self.model(torch.randn(4, 4)).pow(2).mean().backward()

    def finish_step(self, step: int) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.sampler.advance(1)
        self.ckpt.maybe_save(step)

    def run(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            self.forward_backward()
            self.finish_step(step)

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for param_id, values in self.optimizer.state_dict()["state"].items():
            out.update({f"optim/{param_id}/{k}": torch.as_tensor(v).clone() for k, v in values.items()})
        out["rng"] = torch.get_rng_state()
        out["consumed"] = torch.tensor(self.sampler.state_dict()["consumed"])
        out["lr"] = torch.tensor(self.scheduler.get_last_lr())
        return out

    def close(self) -> None:
        self.ckpt.close()
        self.events.close()


def assert_same(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different


def restored(tmp_path: Path) -> tuple[int, dict[str, torch.Tensor], dict]:
    """A fresh worker's restore from the node's snapshots: the step, the state, the restore event."""
    again = Job(tmp_path, seed=1)
    step = again.ckpt.restore()
    state = again.state()
    again.close()
    (event,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "restore"][-1:]
    return step, state, event


def test_a_steady_snapshot_makes_no_buffer_and_no_file(tmp_path: Path, node: KeeperAddress) -> None:
    job = Job(tmp_path)
    job.run(1, 2)  # the first two snapshots make the two slots and the loop's copies
    memory = job.ckpt.memory
    memory.wait_previous()
    made = memory.allocations
    mapped = [s.data.data_ptr() for s in memory.part_writer.slots.made]
    files = {p.name: p.stat().st_ino for p in (node.root / LOCAL).iterdir() if p.suffix == parts.DATA_SUFFIX}
    assert made >= 2 and memory.part_writer.slots.created == 2 and len(files) == 2
    job.run(3, 12)
    memory.wait_previous()
    assert memory.costs.taken == 12 and memory.disabled is None
    assert [r.one_time for r in memory.costs.records] == [True, True] + [False] * 10  # the two that made the slots
    # Each snapshot's exposure runs from its step's end (note_step) to its commit, inside its write's wall time.
    assert all(0 < r.exposed_seconds and r.cpu_seconds > 0 and r.written for r in memory.costs.records)
    assert memory.allocations == made, "a steady snapshot made a buffer"
    assert [s.data.data_ptr() for s in memory.part_writer.slots.made] == mapped  # the same mappings
    data = {p.name: p.stat().st_ino for p in (node.root / LOCAL).iterdir() if p.suffix == parts.DATA_SUFFIX}
    assert data == files, "a steady snapshot made a new data file"
    assert sorted(h.step for h in parts.read_headers(node.root / LOCAL)) == [11, 12]
    job.close()


@pytest.mark.parametrize("phase", PHASES)
def test_a_failure_at_any_phase_of_a_write_leaves_the_snapshot_before_it_whole(
    tmp_path: Path, node: KeeperAddress, phase: str
) -> None:
    job = Job(tmp_path, faults=Faults(phase, 5))
    job.run(1, 4)
    job.ckpt.memory.wait_previous()
    want_4 = job.state()
    job.run(5, 5)
    want_5 = job.state()
    job.ckpt.memory.wait_previous()  # the write of step 5 failed at `phase`: nothing after it ran
    assert job.ckpt.memory.disabled is not None
    stepped = threading.Thread(target=job.optimizer.step, daemon=True)  # its copy never comes: the step goes on
    stepped.start()
    stepped.join(60)
    assert not stepped.is_alive(), "the optimizer step waits for a failed snapshot's copy"
    job.close()
    step, state, event = restored(tmp_path)
    if phase == COMMITTED:  # its header was published: step 5 is whole, nothing is redone
        assert (step, event["source"], event["redone"]) == (5, "memory", 0)
        assert_same(want_5, state)
    else:  # torn: never used; the snapshot before it is, and the one step finished since is redone
        assert (step, event["source"], event["redone"]) == (4, "memory", 1)
        assert_same(want_4, state)


def in_function(thread: threading.Thread, name: str) -> bool:
    """Whether `thread` is running a function called `name` now (anywhere on its stack)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def test_the_snapshot_is_the_state_at_its_step_while_the_next_step_runs(tmp_path: Path, node: KeeperAddress) -> None:
    """The snapshot thread is held before it copies anything until the next step's forward and backward
    ran (batch norm statistics and gradients changed) and the loop is in the optimizer step, where it
    must wait for the copy; released then, the parameters it copies are still those of its step."""
    faults = Faults(PHASES[0], 3, hold=True)
    job = Job(tmp_path, faults=faults)
    job.run(1, 2)
    job.forward_backward()
    job.optimizer.step()
    job.optimizer.zero_grad()
    job.scheduler.step()
    job.sampler.advance(1)
    job.ckpt.maybe_save(3)  # its snapshot's thread holds at its first phase: nothing copied yet
    assert faults.reached.wait(60)
    want_3 = job.state()
    job.forward_backward()  # step 4: a forward (batch norm statistics), a backward (gradients)
    loop = threading.current_thread()

    def release_once_the_step_waits() -> None:
        # Released once the loop waits for the copy in the optimizer step's pre-hook; a loop that did not
        # wait would have finished the step, and the post-hook releases it then, too late for the copy.
        wait_for(lambda: in_function(loop, "wait_sources_free") or step_done.is_set(),
                 timeout=60, what="the loop in the optimizer step")
        faults.release.set()

    step_done = threading.Event()
    job.optimizer.register_step_post_hook(lambda *_: (step_done.set(), faults.release.set()))
    helper = threading.Thread(target=release_once_the_step_waits)
    helper.start()
    job.optimizer.step()  # step 4's update: waits for snapshot 3's copy
    helper.join()
    assert not torch.equal(job.state()["model/0.weight"], want_3["model/0.weight"])  # the live state moved on
    job.ckpt.memory.wait_previous()
    assert job.ckpt.memory.disabled is None
    job.close()
    step, state, _ = restored(tmp_path)
    assert step == 3
    assert_same(want_3, state)


def test_each_snapshots_cost_is_handed_over_once_when_settled_and_waits_are_its_own() -> None:
    costs = SnapshotCosts()
    first = costs.begin(1)
    first.capture_seconds, first.cpu_seconds = 0.001, 0.002
    assert costs.drain() == []  # not written, not seen finished
    first.written = True
    costs.waited(0.004, finished=False, at_step=True)  # the optimizer step waited for its copy...
    assert costs.drain() == []
    costs.waited(0.003, finished=True, at_step=True)  # ...and then for the rest of its write
    assert costs.drain() == [(pytest.approx(0.010), 0.0)] and costs.drain() == []
    assert costs.step_wait_seconds == pytest.approx(0.007)
    second = costs.begin(2)
    second.written, second.cpu_seconds, second.replica_seconds = True, 0.002, 0.0015
    costs.waited(0.0, finished=True, at_step=False)
    failed = costs.begin(3)  # its write failed: no cost to learn from, and the ones after it still count
    costs.waited(0.5, finished=True, at_step=False)
    fourth = costs.begin(4)
    fourth.written = True
    costs.waited(0.001, finished=True, at_step=False)
    slot_made = costs.begin(5)  # made a slot (a layout changed): a one-time cost, not what the interval budgets
    slot_made.written, slot_made.one_time, slot_made.cpu_seconds = True, True, 0.3
    costs.waited(0.0, finished=True, at_step=False)
    assert costs.drain() == [(pytest.approx(0.002), 0.0015), (pytest.approx(0.001), 0.0)]
    assert failed.waited_seconds == 0.5 and costs.taken == 5


def test_a_snapshots_checksums_are_the_ones_every_reader_checks() -> None:
    """All of a slot's chunks checksummed in one pass, on this thread or (past PARALLEL_BYTES) on the pool,
    whose CPU time is counted: the same crc32c per block as `block_checksums`, which every read checks."""
    sizes = (0, 5, BLOCK, BLOCK + 3, 3 * BLOCK)
    small = [memoryview(os.urandom(n)) for n in sizes]
    got, pool_cpu = pieces_checksums(small)
    assert got == [tuple(block_checksums(p)) for p in small] and pool_cpu == 0.0  # this thread's own clock has them
    large = [memoryview(os.urandom(PARALLEL_BYTES // 2 + 1)), memoryview(b""), memoryview(os.urandom(PARALLEL_BYTES // 2))]
    got, pool_cpu = pieces_checksums(large)
    assert got == [tuple(block_checksums(p)) for p in large] and pool_cpu > 0


def test_a_rendered_header_is_the_header(tmp_path: Path, node: KeeperAddress) -> None:
    """The chunk records rendered once per slot make the same header as the records themselves."""
    job = Job(tmp_path)
    job.run(1, 1)
    job.ckpt.memory.wait_previous()
    (header,) = parts.read_headers(node.root / LOCAL)
    again = parts.PartHeader.from_json(header.to_json())
    rendered = {"chunks": json.dumps(header.chunks), "tensors": json.dumps(header.tensors)}
    assert again == header and json.loads(header.to_json(rendered)) == json.loads(header.to_json())
    job.close()
