"""The loop's seam (elastic._worker.run.parts): a part written here plugs into a run without any edit of
the run, its loop or the step vote, is called at each hook in order, and stops the loop by its vote."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import elastic
from elastic._shared.common.errors import PeerLost
from elastic._worker.run.parts import Change, LoopPartBase, Parts
from elastic._worker.runtime.context import WorkerContext


class StopAt(LoopPartBase):
    """Counts the steps it sees end and votes to stop once `last` of them did; records every hook."""

    def __init__(self, last: int) -> None:
        self.last, self.steps, self.calls = last, 0, []
        self.started_from: int | None = None

    def on_group(self, ctx: WorkerContext) -> None:
        self.calls.append(("on_group", ctx.world_size))

    def start(self, core: Any) -> None:
        self.started_from = core.step
        self.calls.append(("start", core.step))

    def before_step(self, step: int) -> None:
        self.calls.append(("before_step", step))

    def body_ended(self, step: int) -> Change:
        self.calls.append(("body_ended", step))
        return Change.NONE

    def step_ended(self, step: int) -> None:
        self.steps += 1
        self.calls.append(("step_ended", step))

    def ballot_size(self, world_size: int) -> int:
        return 1

    def ballot(self) -> Sequence[int]:
        return [int(self.steps >= self.last)]

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change:
        self.calls.append(("after_step", step, ballots))
        return Change.STOP if ballots and ballots[0] else Change.NONE

    def step_done(self, step: int) -> Change:
        self.calls.append(("step_done", step))
        return Change.NONE

    def finish(self) -> None:
        self.calls.append(("finish",))


def _train(tmp_path: Path, part: StopAt, max_steps: int) -> elastic.Run:
    with elastic.Run(device="cpu", seed=3, ckpt_dir=str(tmp_path / "ckpt"), parts=[part]) as run:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.start(model=model, optimizer=optimizer, data=64, batch_size=2)
        for indices in run.batches(max_steps=max_steps):
            model(torch.ones(len(indices), 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        for _ in run.batches(max_steps=max_steps):  # a stopped loop stays stopped
            raise AssertionError("a step after the part stopped the loop")
    return run


def test_a_part_of_the_tests_plugs_in_and_its_vote_stops_the_loop(tmp_path: Path) -> None:
    part = StopAt(5)
    run = _train(tmp_path, part, max_steps=20)
    assert run.step == 5
    assert part.started_from == 0
    names = [call[0] for call in part.calls]
    assert names[:2] == ["on_group", "start"] and names[-1] == "finish"
    per_step = names[2:-1]
    assert per_step == ["before_step", "body_ended", "step_ended", "after_step", "step_done"] * 5  # in order
    assert [call[1] for call in part.calls if call[0] == "before_step"] == [0, 1, 2, 3, 4]
    # alone, every step end is a vote step: the part reads its own ballot back, MAX over one rank
    assert [call[2] for call in part.calls if call[0] == "after_step"] == [(0,), (0,), (0,), (0,), (1,)]
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step"))
    assert checkpoints and checkpoints[-1].endswith("5")  # the final checkpoint is the step it stopped at

    again = StopAt(3)
    resumed = _train(tmp_path, again, max_steps=20)  # restored at step 5: its count starts there
    assert again.started_from == 5 and resumed.step == 8


class VoidsOnce(LoopPartBase):
    """Answers VOID at the body's end of step `at + 1`, once (as the survivors do after healing a failed
    gradient all-reduce): the loop must train that batch again and not count the void attempt."""

    def __init__(self, at: int) -> None:
        self.at, self.voided = at, False

    def body_ended(self, step: int) -> Change:
        if step == self.at and not self.voided:
            self.voided = True
            return Change.VOID
        return Change.NONE


class FailsBookkeeping(LoopPartBase):
    """A collective of step `at`'s bookkeeping fails (once); `heals`: this part heals it when offered."""

    def __init__(self, at: int, *, heals: bool) -> None:
        self.at, self.heals, self.offered = at, heals, []

    def step_ended(self, step: int) -> Change:
        if step == self.at and not self.offered:
            self.offered.append("failing")
            raise RuntimeError("Connection closed by peer\nand more")
        return Change.NONE

    def collective_failed(self, why: str) -> Change | None:
        self.offered.append(why)
        return Change.NONE if self.heals else None


def _batches_seen(tmp_path: Path, parts: list[Any], max_steps: int) -> tuple[list[list[int]], int]:
    seen: list[list[int]] = []
    with elastic.Run(device="cpu", seed=3, ckpt_dir=str(tmp_path / "ckpt"), parts=parts) as run:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.start(model=model, optimizer=optimizer, data=64, batch_size=2)
        for indices in run.batches(max_steps=max_steps):
            seen.append([int(i) for i in indices])
            model(torch.ones(len(indices), 2)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return seen, run.step


def test_a_void_step_is_not_counted_and_its_batch_trains_again(tmp_path: Path) -> None:
    seen, step = _batches_seen(tmp_path / "void", [VoidsOnce(at=2)], max_steps=5)
    plain, _ = _batches_seen(tmp_path / "plain", [], max_steps=5)
    assert step == 5 and len(seen) == 6
    assert seen[2] == seen[3] == plain[2], "the void step's batch again, then on as if it never failed"
    assert seen[:3] + seen[4:] == plain


def test_a_failed_collective_of_the_bookkeeping_is_offered_to_the_parts(tmp_path: Path) -> None:
    healer = FailsBookkeeping(at=2, heals=True)
    _, step = _batches_seen(tmp_path / "healed", [healer], max_steps=4)
    assert step == 4 and healer.offered == ["failing", "Connection closed by peer"]  # its first line
    nobody = FailsBookkeeping(at=2, heals=False)
    with pytest.raises(PeerLost, match="Connection closed by peer"):  # no part heals it: the error stands (one line)
        _batches_seen(tmp_path / "raised", [nobody], max_steps=4)


class Fixed(LoopPartBase):
    def __init__(self, size: int, ballot: Sequence[int], answer: Change = Change.NONE) -> None:
        self.size, self.values, self.answer, self.seen = size, ballot, answer, []

    def ballot_size(self, world_size: int) -> int:
        return self.size if self.size >= 0 else world_size  # -1: a slot per rank

    def ballot(self) -> Sequence[int]:
        return self.values

    def after_step(self, step: int, ballots: tuple[int, ...] | None) -> Change:
        self.seen.append(ballots)
        return self.answer


def _ctx(world_size: int) -> WorkerContext:
    return WorkerContext(rank=0, local_rank=0, world_size=world_size, local_world_size=world_size, restart_count=0,
                         run_id="t", device=torch.device("cpu"), backend="gloo")


def test_ballots_are_laid_end_to_end_each_to_its_size_and_read_back_in_slices() -> None:
    short, long_, silent = Fixed(2, [7]), Fixed(2, [1, 2, 3, 4]), Fixed(0, [9])
    parts = Parts([short, long_, silent])
    parts.on_group(_ctx(2))
    assert parts.ballots() == [7, 0, 1, 2]  # padded with zeros, cut to its size; a size of 0 votes nothing
    assert parts.after_step(1, (5, 6, 7, 8)) == Change.NONE
    assert (short.seen, long_.seen, silent.seen) == ([(5, 6)], [(7, 8)], [()])  # a vote step, to all
    parts.after_step(2, ())  # off a vote step (or a vote laid for another group): no slice
    assert short.seen[-1] is None and long_.seen[-1] is None
    per_rank = Parts([Fixed(-1, [3, 3, 3])])
    per_rank.on_group(_ctx(2))
    assert per_rank.ballots() == [3, 3]
    per_rank.on_group(_ctx(1))  # a smaller group: a size that follows the world size follows it
    assert per_rank.ballots() == [3]


def test_the_strongest_change_wins() -> None:
    def answer(*parts: Fixed) -> Change:
        laid = Parts(parts)
        laid.on_group(_ctx(1))
        return laid.after_step(1, ())

    assert answer(Fixed(0, [], Change.RESHARD), Fixed(0, [], Change.STOP)) == Change.STOP
    assert answer(Fixed(0, [], Change.RESHARD), Fixed(0, [])) == Change.RESHARD
    assert answer() == Change.NONE


def test_nothing_reaches_into_a_runs_private_members() -> None:
    """The loop, its parts, the survivors' adapter and the tools meet the run's shared state (`RunCore`),
    never `Run`'s own private members: a source scan of the package, the recipes and the benchmarks."""
    import re

    from support import REPO

    private = re.compile(r"\b(?:run|_run|self\.run)\._[a-z]\w*")
    found = [f"{path.relative_to(REPO)}: {match.group(0)}"
             for folder in ("elastic", "recipes", "benchmarks") for path in (REPO / folder).rglob("*.py")
             for match in private.finditer(path.read_text())]
    assert found == []
