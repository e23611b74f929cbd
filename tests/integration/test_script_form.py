"""A script written at module level joins with `Run.open()` (no `with`, no dunder calls) and gets the
`with` block's guarantees at exit: a final checkpoint and an "end" event at its end, and a library error
as one line and its exit status, never a traceback. One warm process per case."""

from __future__ import annotations

import sys
from pathlib import Path

import warm

import elastic
from elastic._worker.observe.events import read_events

SCRIPT = '''
import sys
import torch
import elastic

# nanoGPT-style: no main(), no with block
run = elastic.Run(seed=1, ckpt_dir=sys.argv[1], ckpt_every=0, events=sys.argv[2], device="cpu").open()
model = run.ddp(torch.nn.Linear(3, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(64, 3)
run.start(model=model, optimizer=optimizer, data=len(data), batch_size=4)
for indices in run.batches(max_steps=6):
    loss = model(data[indices]).pow(2).mean()
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    run.log(loss)
    if sys.argv[3] == "usage-error" and run.step == 3:
        raise elastic.UsageError("--lr must be positive (the script's own check)")
    if sys.argv[3] == "bug" and run.step == 3:
        raise ZeroDivisionError("a bug of the script")
if sys.argv[3] == "close":
    run.close()
    run.close()  # a second close does nothing
print("script ended at step", run.step)
'''


def test_a_module_level_script_commits_at_its_end_and_a_library_error_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    results = {}
    for case in ("end", "close", "usage-error", "bug"):
        ckpt, events = tmp_path / case / "ckpt", tmp_path / case / "events.jsonl"
        results[case] = warm.run([sys.executable, str(script), str(ckpt), str(events), case], timeout=120)
        done, logged = results[case], read_events(events)
        if case in ("end", "close"):  # the end of the script leaves as the end of a `with` block does
            assert done.returncode == 0, done.stderr
            assert "script ended at step 6" in done.stdout
            assert [e["step"] for e in logged if e["event"] == "end"] == [6]
            name, step, state = elastic.load_newest_model_state(ckpt)
            assert (name, step) == ("step_00000006", 6) and set(state) == {"weight", "bias"}
        elif case == "usage-error":  # one line and the library's status, as run_main gives a main()
            assert done.returncode == 2, done.stderr
            assert done.stderr.strip().splitlines()[-1] == "train.py: error: --lr must be positive (the script's own check)"
            assert "Traceback" not in done.stderr
            assert not [e for e in logged if e["event"] == "end"]  # a failed run commits no final checkpoint
        else:  # the script's own bug keeps python's traceback and status
            assert done.returncode == 1
            assert "Traceback" in done.stderr and "ZeroDivisionError: a bug of the script" in done.stderr
            assert not [e for e in logged if e["event"] == "end"]
