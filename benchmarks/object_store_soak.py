"""The soak of checkpoints in a bucket: the GPT recipe SIGKILLed 100 times at random moments, nothing lost.

    python benchmarks/object_store_soak.py                  # 100 kills, a local S3 server (moto)
    python benchmarks/object_store_soak.py --kills 20 --steps 120

One process (world size 1) trains with `--ckpt-dir s3://.../soak --ckpt-every 2`
and is SIGKILLed a few steps after each start, a random fraction of a step
later: the kills land while shards upload, between the last part and the
manifest, during retention and while the claim is written. It is started again
after each kill; after the last one it trains to `--steps`. An uninterrupted
run of the same arguments into another prefix is the reference.

Prints one line per 10 kills, then the verdict: every restart resumed from a
checkpoint that was committed before the kill (the newest then) and verified
(no "is corrupt" in any log), the final checkpoint is bit-identical to the
reference run's (model, optimizer state and settings), and no object is left in
the bucket that no committed manifest names. Exit status 0 when all hold, 1 otherwise.
The quick form of this soak, 100 deaths at random requests in one process, is
tests/unit/test_bucket_store.py::test_a_hundred_kills_at_random_requests_lose_nothing.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elastic._shared.common.cli import OneLineArgumentParser, int_at_least, run_main  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8",
        "--eval-every", "0", "--device", "cpu"]


def verdict(lives: list[dict[str, Any]], final_equal: bool, leftovers: list[str]) -> tuple[bool, list[str]]:
    """Whether the soak lost nothing, and the problems found. `lives`: per start, `restored` (the step
    it resumed from, 0 for none), `committed_before` (the steps committed before it started),
    `corrupt` (lines of its log naming a corrupt checkpoint)."""
    problems = []
    for i, life in enumerate(lives):
        newest = max(life["committed_before"], default=0)
        if life["restored"] != newest:
            problems.append(f"start {i} resumed from step {life['restored']}, the newest committed was {newest}")
        if life["corrupt"]:
            problems.append(f"start {i} met a corrupt checkpoint: {life['corrupt'][0]}")
    if not final_equal:
        problems.append("the final checkpoint differs from the uninterrupted run's")
    if leftovers:
        problems.append(f"{len(leftovers)} objects no committed manifest names, e.g. {leftovers[0]}")
    return not problems, problems


def _events(path: Path) -> list[dict[str, Any]]:
    from elastic._worker.observe.events import read_events

    return list(read_events(path)) if path.exists() else []


def _committed(url: str) -> list[int]:
    from elastic._shared.storage.stores import open_store

    return sorted(c.step for c in open_store(url, check=False).committed())


def _final(url: str) -> tuple[int, dict[str, Any], dict[str, Any]]:
    from elastic._shared.storage.manifest import TRAINER_FILE
    from elastic._shared.storage.stores import open_store
    from elastic._worker.checkpoint.reader import read_tensors

    store = open_store(url, check=False)
    candidate = store.committed()[0]
    manifest = store.verify(candidate)
    trainer = store.load_state_file(candidate, manifest, TRAINER_FILE)
    return manifest.step, read_tensors(store, candidate, manifest, trainer), trainer


def _leftovers(url: str) -> list[str]:
    from elastic._shared.storage.manifest import MANIFEST
    from elastic._shared.storage.stores import open_store

    store = open_store(url, check=False)
    named = {c.name: store.read_checked_manifest(c).parts for c in store.committed()}
    prefix = store.root.key() + "/"
    out = []
    for info in store.objects.list(prefix):
        rest = info.key[len(prefix):].split("/")
        if rest in (["writer.json"], ["latest"]) or (len(rest) == 2 and rest[1] == MANIFEST):
            continue
        if not (len(rest) == 3 and named.get(rest[0]) == rest[1]):
            out.append(info.key)
    return out


def soak(url: str, reference: str, corpus: Path, workdir: Path, kills: int, steps: int, rng: random.Random,
         env: dict[str, str]) -> int:
    args = [sys.executable, str(REPO / "recipes" / "gpt.py"), "--data", str(corpus), "--max-steps", str(steps), *TINY]
    done = subprocess.run([*args, "--ckpt-dir", reference, "--ckpt-every", "0"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return 1
    lives: list[dict[str, Any]] = []
    events = workdir / "events.jsonl"
    while True:
        before = _committed(url)
        log = workdir / f"life{len(lives)}.log"
        seen = len(_events(events))
        with open(log, "wb") as out:
            process = subprocess.Popen([*args, "--ckpt-dir", url, "--ckpt-every", "2", "--events", str(events)],
                                       env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        killed = False
        if len(lives) < kills:
            start = None
            deadline = time.monotonic() + 120
            while process.poll() is None and time.monotonic() < deadline:
                new = _events(events)[seen:]
                steps_now = [e["step"] for e in new if e["event"] == "step"]
                if start is None and steps_now:
                    start, target = steps_now[0], steps_now[0] + rng.randint(0, 5)
                if start is not None and steps_now and steps_now[-1] >= target:
                    time.sleep(rng.uniform(0, 0.05))  # a random moment within the save of the next steps
                    os.killpg(process.pid, signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.01)
        code = process.wait(timeout=600)
        text = log.read_text(errors="replace")
        restores = [e for e in _events(events)[seen:] if e["event"] == "restore"]
        lives.append({"restored": restores[0]["step"] if restores else 0, "committed_before": before,
                      "corrupt": [line for line in text.splitlines() if "is corrupt" in line]})
        if killed and len(lives) % 10 == 0:
            print(f"{len(lives)} kills; committed now: steps {_committed(url)[-3:]}", flush=True)
        if not killed:
            if code != 0:
                print(f"the last start exited with {code}:\n{text[-3000:]}", file=sys.stderr)
                return 1
            break
    step, got, got_trainer = _final(url)
    ref_step, want, want_trainer = _final(reference)
    equal = (step == ref_step == steps and want.keys() == got.keys()
             and all(_same(want[k], got[k]) for k in want) and got_trainer["optimizer"] == want_trainer["optimizer"])
    ok, problems = verdict(lives, equal, _leftovers(url))
    print(f"{len(lives) - 1} kills, {len(lives)} starts; final step {step}, "
          f"{'bit-identical to' if equal else 'DIFFERENT from'} the uninterrupted run")
    for problem in problems:
        print(f"problem: {problem}")
    print("nothing lost" if ok else "LOST SOMETHING")
    return 0 if ok else 1


def _same(a: Any, b: Any) -> bool:
    import torch

    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="benchmarks/object_store_soak.py", description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int_at_least(1), default=100)
    parser.add_argument("--steps", type=int_at_least(4), default=500, help="steps of the run")
    parser.add_argument("--seed", type=int, default=45)
    args = parser.parse_args(argv)
    from elastic.chaos.s3_server import S3Server

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, S3Server(log=Path(tmp) / "s3.log") as server:
        workdir = Path(tmp)
        corpus = workdir / "corpus.txt"
        rng = random.Random(args.seed)
        words = "the quick brown fox jumps over a lazy dog while every worker keeps its step".split()
        corpus.write_text(" ".join(rng.choice(words) for _ in range(60_000)))
        bucket = f"soak-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        env = server.environment(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})  # this process reads the bucket too
        return soak(f"s3://{bucket}/soak", f"s3://{bucket}/reference", corpus, workdir, args.kills, args.steps, rng, env)


if __name__ == "__main__":
    sys.exit(run_main(main))
