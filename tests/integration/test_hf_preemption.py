"""A SIGTERM reaches a Hugging Face recipe (the Trainer's, the accelerate one's) in the middle of training:
it commits the step it is at and exits 143 with one line; the next start resumes from that step."""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import warm  # noqa: E402
from support import REPO, make_text, worker_env  # noqa: E402

from elastic.chaos.verdict import verified_final_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "4"]


@pytest.mark.parametrize("recipe", ["hf_trainer.py", "hf_accelerate.py"])
def test_sigterm_commits_the_step_and_exits_143(recipe: str, tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_text(make_text(random.Random(2), 20_000))
    events, ckpt = tmp_path / "events.jsonl", tmp_path / "ckpt"
    command = [sys.executable, str(REPO / "recipes" / recipe), "--data", str(data), "--max-steps", "100000",
               "--ckpt-dir", str(ckpt), "--ckpt-every", "1000", "--eval-every", "0", "--events", str(events), *MODEL]
    cwd = tmp_path / "cwd"  # no --output-dir: the final model goes next to the checkpoints, not here
    cwd.mkdir()
    out_file, err_file = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_file, "wb") as out, open(err_file, "wb") as err:  # forked warm (tests/warm.py)
        proc = warm.start(command, stdout=out, stderr=err, env=worker_env(), cwd=cwd)
    deadline = time.monotonic() + 120
    while not (events.exists() and any(json.loads(line)["event"] == "step" for line in events.read_text().splitlines()[:-1])):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no step in 120 s: {out_file.read_text(errors='replace')}{err_file.read_text(errors='replace')}")
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    out, err = out_file.read_text(errors="replace"), err_file.read_text(errors="replace")
    assert code == 143, out + err
    lines = [line for line in err.splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 1 and "checkpoint committed" in lines[0], err
    assert "Traceback" not in err
    stopped = [json.loads(line) for line in events.read_text().splitlines()]
    step = max(r["step"] for r in stopped if r["event"] == "checkpoint")
    name, error = verified_final_checkpoint(ckpt, step)
    assert name, error
    again = warm.run([*command[:5], str(step + 2), *command[6:]], timeout=180, env=worker_env(), cwd=cwd)
    assert again.returncode == 0, again.stderr
    assert list(cwd.iterdir()) == []  # the working directory is left as it was
    assert (ckpt / "hf-model" / "config.json").is_file()
    starts = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["step"] for r in starts if r["event"] == "start"] == [0, step]
