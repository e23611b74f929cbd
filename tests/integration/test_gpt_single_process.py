"""The GPT recipe as a plain `python` process, and its answers to bad input."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from support import TINY_MODEL, run_recipe

from elastic._worker.observe.events import read_events


def test_runs_five_steps_on_default_data_without_torchrun(tmp_path: Path) -> None:
    events_path = tmp_path / "events.jsonl"
    result = run_recipe("--max-steps", "5", "--events", str(events_path))
    assert result.returncode == 0, result.stderr[-2000:]
    events = list(read_events(events_path))
    assert [e["event"] for e in events] == ["start", "step", "step", "step", "step", "step", "eval", "end"]
    assert all(e["world_size"] == 1 and e["restart"] == 0 for e in events)


def test_a_taken_metrics_port_is_one_warning_and_training_finishes(tmp_path: Path, tiny_corpus: Path) -> None:
    events_path = tmp_path / "events.jsonl"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_recipe(
            "--data", str(tiny_corpus), "--max-steps", "6", "--eval-every", "0", "--events", str(events_path),
            "--metrics-port", str(port), *TINY_MODEL,
        )
    assert result.returncode == 0, result.stderr[-2000:]
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and f"metrics: cannot serve on 127.0.0.1:{port}" in warnings[0], result.stderr
    assert [e["event"] for e in read_events(events_path)][-1] == "end"


@pytest.mark.slow
def test_compile_flag_trains_a_compiled_model(tmp_path: Path, tiny_corpus: Path) -> None:
    events_path = tmp_path / "events.jsonl"
    result = run_recipe(
        "--data", str(tiny_corpus), "--compile", "--max-steps", "3", "--eval-every", "0",
        "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "2",
        "--events", str(events_path), timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert [e["step"] for e in read_events(events_path) if e["event"] == "step"] == [1, 2, 3]


def test_a_run_ends_with_a_sample_and_generate_reads_the_newest_checkpoint(tmp_path: Path, tiny_corpus: Path) -> None:
    ckpt = tmp_path / "ckpt"
    trained = run_recipe(
        "--data", str(tiny_corpus), "--max-steps", "8", "--ckpt-every", "4", "--ckpt-dir", str(ckpt),
        "--eval-every", "0", "--sample-tokens", "30", *TINY_MODEL,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "sample:\ndef " in trained.stdout + trained.stderr, "a run shows what it learned"

    first = run_recipe("--generate", "class ", "--ckpt-dir", str(ckpt), "--sample-tokens", "40", "--seed", "5", *TINY_MODEL)
    again = run_recipe("--generate", "class ", "--ckpt-dir", str(ckpt), "--sample-tokens", "40", "--seed", "5", *TINY_MODEL)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.startswith("class ") and len(first.stdout.encode()) >= len("class ") + 1
    assert first.stdout == again.stdout, "the same seed samples the same text"
    assert "sampling from step_00000008 (step 8)" in first.stderr
    assert not list(ckpt.glob("*.corrupt*")), "--generate only reads"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([], "--generate needs --ckpt-dir"),
        (["--ckpt-dir", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (["--n-embd", "96"], "pass the model flags the run was trained with"),
    ],
)
def test_generate_refuses_in_one_line(tmp_path: Path, tiny_corpus: Path, extra: list[str], expected: str) -> None:
    if "--n-embd" in extra:  # a checkpoint of the tiny model, read with another shape
        ckpt = tmp_path / "ckpt"
        trained = run_recipe("--data", str(tiny_corpus), "--max-steps", "2", "--ckpt-dir", str(ckpt), "--eval-every", "0",
                             "--sample-tokens", "0", *TINY_MODEL)
        assert trained.returncode == 0, trained.stderr[-2000:]
        extra = ["--ckpt-dir", str(ckpt), *TINY_MODEL, *extra]
    result = run_recipe("--generate", "x", *extra)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0], result.stderr
    assert "Traceback" not in result.stderr
