"""What several benchmarks need alike, written once: every helper here is used by two or more scripts in
benchmarks/. A helper starts in the benchmark that needs it and moves here once a second benchmark
needs it (never a copy in the second one); a helper of one benchmark stays in that benchmark.

- figures: `median` (of what there is, or a value for none);
- the command line: `comma_list`, `world_sizes`, `fail` (one line on stderr, exit 2);
- files: `write_atomically`, `read_jsonl` (a log being written: a torn line is passed over),
  `memory_dir` (/dev/shm where it is writable);
- processes: `wait_until`, `kill_tree` (a launcher and every worker below it);
- measuring: `memory_copies` (a local memory copy, the bound on any transport), `HookWait` (what the
  loop waits in the checkpoint manager's optimizer pre-hook, per save).

Elsewhere, on purpose: the result file with its provenance (provenance.py: a file format of its own,
written by the benchmarks and read by render.py; it writes with `write_atomically`); what one family of
benchmarks shares about what it measures (soak_measure.py, scale_model.py, scale_sim.py, scale_count.py,
overhead_snapshots.py, hf_resume_common.py, snapshot_auth's keeper for peer_fetch); what the library
already has (elastic.chaos.netns.free_port, elastic._worker.observe.events.read_events).
tests/unit/test_benchmark_common.py fails when two benchmarks define the same function again (the same
body under the same name, or a body of several statements under another).

Standard library only, so that render.py and a worker running an older tree of the library
(checkpoint_worker.py) import it as well; `kill_tree` imports the library's process tree when called.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


# -- figures ----------------------------------------------------------------------------------------------


def median(values: Iterable[float], empty: Any = None) -> Any:
    """The median of `values` (the mean of the middle two of an even count), or `empty` when there are none."""
    values = list(values)
    return statistics.median(values) if values else empty


# -- the command line -------------------------------------------------------------------------------------


def comma_list(text: str) -> list[str]:
    """The names in `text`, comma-separated, each stripped, empty ones left out: "a, b,," -> ["a", "b"]."""
    return [name.strip() for name in text.split(",") if name.strip()]


def world_sizes(parser: argparse.ArgumentParser, text: str, why: str) -> list[int]:
    """--ranks' world sizes, comma-separated, each at least 2; else `parser`'s error, which says `why` one
    rank is not enough."""
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        parser.error(f"--ranks takes world sizes, comma-separated, not {text!r}")
    if not sizes or min(sizes) < 2:
        parser.error(f"--ranks: every world size must be at least 2 ({why})")
    return sizes


def fail(prog: str, message: str) -> NoReturn:
    """Refuse the command line as argparse does, in one line: `prog: error: message` on stderr, exit 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -- files ------------------------------------------------------------------------------------------------


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: a reader sees the old file or the new one, never half of one
    (a temporary file beside it, renamed over it; removed again if anything fails)."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, in order; none when there is no file yet. A line that is not JSON (a
    torn last line of a killed writer, a line still being written, a blank one) is passed over, silently:
    a benchmark reads its jobs' logs again and again while they grow."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def memory_dir() -> str | None:
    """/dev/shm where this process may write there (files in memory: no disk in what is measured), else None:
    `tempfile`'s own default folder."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


# -- processes --------------------------------------------------------------------------------------------


def wait_until(condition: Callable[[], T], timeout: float, interval: float = 0.05) -> T | None:
    """`condition()`'s first true value, asked every `interval` s for `timeout` s; None if it never was."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    return None


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every process below it (torchrun starts each worker in a session of its own,
    so no process group holds them all); one gone already is passed over."""
    from elastic._agent.launcher.proctree import descendants

    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- measuring --------------------------------------------------------------------------------------------


def memory_copies(nbytes: int, rounds: int) -> list[float]:
    """Seconds of each of `rounds` copies of `nbytes` from one buffer in memory to another: for scale, the
    bound on any transport of those bytes."""
    buffer, source = bytearray(nbytes), memoryview(bytes(nbytes))
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        buffer[:] = source
        seconds.append(time.perf_counter() - started)
    return seconds


class HookWait:
    """The seconds a training loop waits in the checkpoint manager's optimizer pre-hook (where a step waits
    for the previous save's deferred copy), per save.

    Pre-hooks run in the order they were registered: make this before the manager (its first hook), and
    call `after_manager(calls)` once the manager is made (its second); each optimizer step's gap between
    the two counts to the newest save step in `calls` (save step -> anything; nothing counts before the
    first save). `seconds`: save step -> seconds waited in the optimizer steps after it.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.seconds: dict[int, float] = {}
        self._started = 0.0
        self._handles = [optimizer.register_step_pre_hook(self._before_manager)]

    def _before_manager(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def after_manager(self, calls: Mapping[int, Any]) -> None:
        def after_manager_hook(*_: Any) -> None:
            if calls:
                last = max(calls)
                self.seconds[last] = self.seconds.get(last, 0.0) + time.perf_counter() - self._started

        self._handles.append(self.optimizer.register_step_pre_hook(after_manager_hook))

    def remove(self) -> None:
        """Take both hooks off the optimizer."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
