"""A benchmark's result file: the figures it printed, as JSON, with where they came from.

Every benchmark whose figures reach the README or docs/results.md writes them with `write_result`
(its `--json FILE` option); the docs' tables are rendered from these files, never typed. A file is

    {"benchmark": NAME, "provenance": {...}, "results": {...}}

where `provenance` says how the figures were made: the command line, the commit (and whether the
tree had uncommitted changes), the torch and Python versions, the machine (CPU model, cores, memory,
and its load average when the figures were written: a shared machine shows) and the date (UTC). `results` is the benchmark's own, JSON-safe (no NaN or infinity: `None` instead).

Invariants: the file is replaced atomically (a reader never sees half of one); a result that is not
JSON-safe is refused before anything is written.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import write_atomically

REPO = Path(__file__).resolve().parent.parent
FORMAT = 1


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _load() -> float | None:
    """The machine's load average over the last 15 minutes (what else ran while the figures were made)."""
    try:
        return round(os.getloadavg()[2], 2)
    except OSError:
        return None


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """How the figures were made: command, commit, versions, machine, date."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    # result files rewritten by a series of benchmarks change no code: they do not make the tree dirty
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {
        "format": FORMAT,
        "command": " ".join([Path(sys.argv[0]).as_posix() if argv is None else "", *(sys.argv[1:] if argv is None else argv)]).strip(),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "torch": torch_version,
        "python": platform.python_version(),
        "machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(), "arch": platform.machine(),
                    "load_15min": _load()},
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
    }


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as None (JSON has neither); tuples as lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_result(path: str | os.PathLike[str], benchmark: str, results: dict[str, Any], argv: list[str] | None = None) -> Path:
    """Write `results` of `benchmark` with its provenance to `path`, atomically; returns the path."""
    document = {"benchmark": benchmark, "provenance": provenance(argv), "results": json_safe(results)}
    text = json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n"
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, text)
    return target


def read_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A result file written by `write_result` (checked: its three parts are there)."""
    document = json.loads(Path(path).read_text())
    if not isinstance(document, dict) or not {"benchmark", "provenance", "results"} <= document.keys():
        raise ValueError(f"{path}: not a benchmark result file (needs benchmark, provenance, results)")
    return document
