"""The CIFAR recipe's command line, in process: what it refuses, and how it sizes a run."""

from __future__ import annotations

import pickle
from pathlib import Path

import cifar
import pytest
from support import write_cifar10

from elastic._shared.common.cli import run_main
from elastic._worker.run.schedules import OneCycle, WarmupCosine


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-steps", "5", "--epochs", "2"], "argument --epochs: not allowed with argument --max-steps"),
        (["--data", "d", "--fake-data"], "argument --fake-data: not allowed with argument --data"),
        (["--model", "vgg"], "argument --model: invalid choice: 'vgg'"),
        (["--schedule", "step"], "argument --schedule: invalid choice: 'step'"),
        (["--label-smoothing", "1.5"], "argument --label-smoothing: 1.5 must be in [0, 1)"),
        (["--workers", "-1"], "argument --workers: -1 must be at least 0"),
        (["--epochs", "0"], "argument --epochs: 0.0 must be a positive finite number"),
        (["--metrics-port", "70000"], "argument --metrics-port: 70000 is not a port number"),
        (["--momentum", "0"], "argument --momentum: 0.0 must be above 0"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(args: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cifar.main(args)
    assert exit_info.value.code == 2
    assert expected in one_line_error(capsys)


def test_a_malformed_data_set_is_refused_before_joining_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    write_cifar10(tmp_path, train=20, test=5)
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_2", "wb") as f:
        pickle.dump({"data": [1, 2, 3], "labels": [0]}, f)
    monkeypatch.setattr(cifar, "train", lambda *a, **k: pytest.fail("joined the job with bad data"))
    assert run_main(cifar.main, ["--data", str(tmp_path)]) == 2
    line = one_line_error(capsys)
    assert "cifar-10-batches-py/data_batch_2 is not a CIFAR-10 python batch" in line


def test_epochs_become_the_steps_that_cover_them_at_this_world_size() -> None:
    args = cifar.build_parser().parse_args(["--epochs", "2", "--batch-size", "16"])
    assert cifar.total_steps(args, num_samples=320, world_size=2) == 20
    assert cifar.total_steps(args, num_samples=330, world_size=2) == 21  # a last partial batch counts
    assert cifar.total_steps(cifar.build_parser().parse_args(["--batch-size", "100"]), 1000, 1) == 300  # 30 epochs
    assert cifar.total_steps(cifar.build_parser().parse_args(["--max-steps", "7"]), 1000, 4) == 7


def test_schedules_warm_up_over_a_share_of_the_run_unless_told() -> None:
    parse = cifar.build_parser().parse_args
    assert cifar.lr_schedule(parse([]), 100) == OneCycle(25, 100)
    assert cifar.lr_schedule(parse(["--schedule", "cosine"]), 100) == WarmupCosine(2, 100, min_ratio=0.0)
    assert cifar.lr_schedule(parse(["--warmup-steps", "500"]), 100) == OneCycle(100, 100)


def test_after_a_resize_epochs_end_where_the_samples_left_run_out() -> None:
    from elastic._worker.data.sampler import ElasticSampler

    args = cifar.build_parser().parse_args(["--epochs", "2", "--batch-size", "16"])
    sampler = ElasticSampler(320, batch_size=16, seed=0)
    for _ in range(5):  # 5 steps at world size 2: 160 of the 640 samples
        sampler.advance(2)
    assert cifar.steps_for_epochs_left(args, sampler, 5, images_per_step=16) == 5 + 30  # now alone: 480 / 16
    assert cifar.steps_for_epochs_left(args, sampler, 5, images_per_step=64) == 5 + 8  # four ranks: ceil(480 / 64)
