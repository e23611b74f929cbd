"""The GPT recipe's answers to bad input, in process: one line on stderr and exit status 2."""

from __future__ import annotations

from pathlib import Path

import gpt
import pytest

from elastic._shared.common.cli import run_main


@pytest.fixture
def run_gpt(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """`python recipes/gpt.py ARGS` in this process: (exit status, stderr). The recipe's own logging
    setup and its import prefetch are left out: they would reconfigure this test process."""
    monkeypatch.setattr(gpt, "configure_logging", lambda **_: None)
    monkeypatch.setattr(gpt, "prefetch_slow_imports", lambda: None)

    def run(*args: str) -> tuple[int, str]:
        try:
            status = run_main(gpt.main, list(args))
        except SystemExit as exc:  # argparse's one-line refusals
            status = int(exc.code or 0)
        return status, capsys.readouterr().err

    return run


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data", "/no/such/corpus.txt"], "--data /no/such/corpus.txt: no such file or folder"),
        (["--batch-size", "0"], "argument --batch-size: 0 must be at least 1"),
        (["--ckpt-keep", "1"], "argument --ckpt-keep: 1 must be at least 2"),
        (["--ckpt-every", "-5"], "argument --ckpt-every: '-5' is not a number of steps (0 or more) or of epochs (2e)"),
        (["--max-steps", "ten"], "argument --max-steps: 'ten' is not an integer"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--metrics-port", "70000"], "argument --metrics-port: 70000 is not a port number"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], expected: str, run_gpt) -> None:
    status, stderr = run_gpt(*args, "--max-steps", "1") if "--max-steps" not in args else run_gpt(*args)
    assert status == 2
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert expected in lines[0]


def test_corpus_shorter_than_one_sequence_is_one_line_and_exit_2(tmp_path: Path, run_gpt) -> None:
    short = tmp_path / "short.txt"
    short.write_text("too short to hold a sequence")
    status, stderr = run_gpt("--data", str(short), "--block-size", "64")
    assert status == 2
    (line,) = stderr.strip().splitlines()
    assert f"{short} has 28 bytes, fewer than two sequences of 65 bytes" in line


def test_empty_data_folder_is_one_line_and_exit_2(tmp_path: Path, run_gpt) -> None:
    status, stderr = run_gpt("--data", str(tmp_path))
    assert status == 2
    (line,) = stderr.strip().splitlines()
    assert "the folder holds no files" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible")
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(tiny_corpus: Path, run_gpt) -> None:
    status, stderr = run_gpt("--data", str(tiny_corpus), "--device", "cuda")
    assert status == 2
    (line,) = [l for l in stderr.strip().splitlines() if "error" in l]
    assert "no CUDA device is visible" in line
