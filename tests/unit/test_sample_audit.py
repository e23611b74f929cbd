"""The exactly-once audit rebuilds a job's history from per-rank sample records."""

from __future__ import annotations

import json
from pathlib import Path

from elastic._worker.data.sampler import ElasticSampler
from elastic.chaos.samples import append_record, audit

N, BATCH = 50, 4


class FakeJob:
    """Writes the records `python -m elastic.chaos.samples` would, for rounds we script."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = prefix
        self.clock = 0.0
        self.rounds = 0
        self.checkpoints: dict[int, dict[str, int]] = {0: ElasticSampler(N, batch_size=BATCH, seed=3).state_dict()}

    def round(
        self, *, resume: int, world: int, until: int, checkpoint_every: int = 5, skip_rank: int | None = None,
        started: float | None = None, corrupt_step: int | None = None,
    ) -> None:
        """Resume from the checkpoint of step `resume` at `world` ranks and train to `until`."""
        self.rounds += 1
        if started is not None:
            self.clock = started
        sampler = ElasticSampler(N, batch_size=BATCH, seed=3)
        sampler.load_state_dict(self.checkpoints[resume])
        for step in range(resume + 1, until + 1):
            for rank in range(world):
                if rank == skip_rank and step == until:
                    continue
                self.clock += 0.01
                indices = sampler.local_batch(rank, world).tolist()
                if step == corrupt_step and rank == 0:
                    indices[0] = (indices[0] + 1) % N  # a sampler bug: one sample swapped for another
                record = {
                    "step": step, "round": f"r{self.rounds}", "round_start": resume, "time": self.clock,
                    "rank": rank, "world_size": world, "epoch": sampler.state.epoch,
                    "consumed": sampler.state.consumed, "num_samples": N, "batch_size": BATCH, "seed": 3,
                    "indices": indices,
                }
                append_record(self.prefix, rank, record)
            sampler.advance(world)
            if step % checkpoint_every == 0:
                self.checkpoints[step] = sampler.state_dict()


def test_a_history_of_kills_and_resizes_uses_every_sample_once(tmp_path: Path) -> None:
    job = FakeJob(tmp_path / "samples")
    job.round(resume=0, world=2, until=12)   # killed after step 12: steps 11-12 are lost
    job.round(resume=10, world=1, until=17)  # node lost: world size 1, killed again after 17
    job.round(resume=15, world=3, until=40)  # a node joined
    result = audit(tmp_path / "samples")
    assert result.ok, result.problems
    assert (result.first_step, result.last_step, result.steps) == (1, 40, 40)
    assert result.samples == 10 * 2 * BATCH + 5 * 1 * BATCH + 25 * 3 * BATCH
    assert result.epochs_complete == result.samples // N
    assert result.summary().startswith("samples: each once (steps 1-40")


def test_a_round_that_resumed_too_far_back_trains_samples_twice(tmp_path: Path) -> None:
    job = FakeJob(tmp_path / "samples")
    job.round(resume=0, world=2, until=10)
    job.round(resume=5, world=2, until=10)
    # A third round that claims to resume at 10 but was given step 5's sampler state.
    job.checkpoints[10] = job.checkpoints[5]
    job.round(resume=10, world=2, until=20)
    result = audit(tmp_path / "samples")
    assert not result.ok
    assert any("step 11 starts at" in p for p in result.problems), result.problems
    assert any("trained twice" in p for p in result.problems), result.problems


def test_a_step_missing_a_rank_is_reported(tmp_path: Path) -> None:
    job = FakeJob(tmp_path / "samples")
    job.round(resume=0, world=2, until=8, skip_rank=1)
    result = audit(tmp_path / "samples")
    assert result.problems == ["step 8: records of ranks [0], not one per rank"]


def test_a_job_resumed_mid_epoch_is_audited_from_where_it_resumed(tmp_path: Path) -> None:
    job = FakeJob(tmp_path / "samples")
    job.round(resume=0, world=2, until=5)
    for log in tmp_path.glob("samples.rank*"):
        log.unlink()  # an earlier run whose records we do not have
    job.round(resume=5, world=2, until=30)
    result = audit(tmp_path / "samples")
    assert result.ok, result.problems
    assert (result.first_step, result.last_step) == (6, 30)


def test_no_records_is_not_a_pass(tmp_path: Path) -> None:
    result = audit(tmp_path / "nothing")
    assert not result.ok and "no sample records" in result.summary()


def test_two_rounds_training_at_once_are_a_split_brain(tmp_path: Path) -> None:
    job = FakeJob(tmp_path / "samples")
    job.round(resume=0, world=2, until=10)
    job.round(resume=10, world=1, until=20, started=0.05)  # while the first was still training
    result = audit(tmp_path / "samples")
    assert any("split brain" in p for p in result.problems), result.problems


def test_a_rank_cut_off_that_takes_its_next_batch_late_is_no_split_brain_but_two_ranks_are(tmp_path: Path) -> None:
    """A partition under a loaded machine: rank 1 finished step 10 alone (its peer hung in it), was held 5 s
    by a copy to the lost peer, and took step 11's batch after the other node's new round began. Step 11
    never completed (rank 0 never entered it): that record is no training. Both ranks taking it would be."""
    for late_ranks, split in (([1], False), ([0, 1], True)):
        prefix = tmp_path / f"late{len(late_ranks)}" / "samples"
        prefix.parent.mkdir()
        job = FakeJob(prefix)
        job.round(resume=0, world=2, until=10)
        job.round(resume=10, world=1, until=20, started=1.0)
        for rank in late_ranks:
            last = [json.loads(line) for line in Path(f"{prefix}.rank{rank}").read_text().splitlines() if line]
            step_10 = next(r for r in last if r["round"] == "r1" and r["step"] == 10)
            append_record(prefix, rank, {**step_10, "step": 11, "time": 1.5})
        result = audit(prefix)
        assert any("split brain" in p for p in result.problems) == split, result.problems
        assert split or result.ok, result.problems


def test_a_sample_swapped_for_another_mid_epoch_is_caught(tmp_path: Path) -> None:
    """No complete epoch to count on: the step itself must hold what the epoch order puts there."""
    job = FakeJob(tmp_path / "samples")
    job.round(resume=0, world=2, until=4, corrupt_step=3)
    result = audit(tmp_path / "samples")
    assert result.problems == ["step 3: 1 of its samples are not those the epoch order puts at (0, 16)"]


def test_a_record_torn_by_a_kill_does_not_hide_the_next_one(tmp_path: Path) -> None:
    job = FakeJob(tmp_path / "samples")
    job.round(resume=0, world=2, until=7)
    with open(tmp_path / "samples.rank0", "a") as log:
        log.write('{"step": 8, "round": "r1", "ind')  # SIGKILL in the middle of a write
    job.round(resume=5, world=2, until=12)
    result = audit(tmp_path / "samples")
    assert result.ok, result.problems
    assert (result.first_step, result.last_step) == (1, 12)


def test_the_audit_is_a_command_a_pass_one_line_a_failure_its_problems_and_exit_1(tmp_path: Path, capsys) -> None:
    """`python -m elastic.chaos audit PREFIX` (run here in this process, through run_main as the module is)."""
    from elastic._shared.common.cli import run_main
    from elastic.chaos.__main__ import main

    good = FakeJob(tmp_path / "good")
    good.round(resume=0, world=2, until=12)
    good.round(resume=10, world=1, until=20)
    assert run_main(main, ["audit", str(tmp_path / "good")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [audit(tmp_path / "good").summary()] and out.startswith("samples: each once") and not err

    bad = FakeJob(tmp_path / "bad")
    bad.round(resume=0, world=2, until=12, corrupt_step=7)
    assert run_main(main, ["audit", str(tmp_path / "bad")]) == 1
    out, err = capsys.readouterr()
    assert "  step 7: 1 of its samples are not those the epoch order puts at" in out
    assert err.count("\n") == 1 and f"error: the audit of {tmp_path / 'bad'} found" in err

    assert run_main(main, ["audit", str(tmp_path / "none")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "no sample records at" in err


def test_a_step_trained_again_from_other_random_streams_is_drift(tmp_path: Path, capsys) -> None:
    """Records carry a digest of the random streams at each step's start: a step lost with a round and trained
    again after a restore must start from the same ones (work between steps outside run.pause() moves them)."""
    from elastic._shared.common.cli import run_main
    from elastic.chaos.__main__ import main
    from elastic.chaos.samples import read_records

    def job(prefix: Path, *, drift_at: int | None) -> None:
        fake = FakeJob(prefix)
        fake.round(resume=0, world=2, until=12)  # killed after 12: 11 and 12 are trained again
        fake.round(resume=10, world=2, until=20)
        lines = []
        for rank in (0, 1):
            path = Path(f"{prefix}.rank{rank}")
            for line in path.read_text().splitlines():
                if line.strip():
                    record = json.loads(line)
                    again = record["round"] == "r2" and record["step"] == drift_at and rank == 1
                    record["rng"] = f"s{record['step']}r{rank}" + ("x" if again else "")
                    lines.append((rank, record))
            path.write_text("")
        for rank, record in lines:
            append_record(prefix, rank, record)
        assert len(read_records(prefix)) == 2 * 12 + 2 * 10

    job(tmp_path / "same", drift_at=None)
    result = audit(tmp_path / "same")
    assert result.ok and not result.drift and result.streams_compared == 2, result
    assert "random streams equal at 2 steps trained again" in result.summary()

    job(tmp_path / "drift", drift_at=12)
    result = audit(tmp_path / "drift")
    assert result.ok and result.streams_compared == 2 and len(result.drift) == 1 and result.drift[0].startswith("step 12:")
    assert run_main(main, ["audit", str(tmp_path / "drift")]) == 1
    out, _ = capsys.readouterr()
    assert "random streams DRIFTED at 1 of 2 steps trained again" in out and "  step 12: trained again" in out

