"""The recipe command line contract of DESIGN.md, shared by every recipe.

Each recipe adds its own model and data flags, and its own `--max-steps`,
`--batch-size`, `--lr`, `--seed` and `--data` (their defaults and meaning
differ per recipe); the flags here drive the runtime and mean the same in all:
where the event log goes, the device, metrics, checkpoints, and how a worker
reacts to a dead peer, a SIGTERM or a hang.
"""

from __future__ import annotations

import argparse
from typing import Any

from elastic.cli import (
    OneLineArgumentParser,
    int_at_least,
    non_negative_float,
    non_negative_int,
    positive_float,
)
from elastic.metrics import add_metrics_arguments
from elastic.runtime import DEVICE_CHOICES


def add_runtime_arguments(parser: argparse.ArgumentParser, *, ckpt_every: int) -> None:
    """--events, --device, --metrics-port/--metrics-host, --ckpt-dir/--ckpt-every/--ckpt-keep,
    --ckpt-max-failures/--ckpt-timeout/--ckpt-restore-timeout, --snapshot-every, --collective-timeout, --term-grace, --hang-timeout."""
    p = parser
    p.add_argument("--events", default=None, help="append the JSON-lines event log here (rank 0)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    add_metrics_arguments(p)
    p.add_argument("--ckpt-dir", default=None, help="commit checkpoints here and resume from the newest good one")
    p.add_argument(
        "--ckpt-every", type=non_negative_int, default=ckpt_every, help="steps between checkpoints (0: only the final one)"
    )
    p.add_argument("--ckpt-keep", type=int_at_least(2), default=3, help="committed checkpoints to keep (a fallback needs 2)")
    p.add_argument(
        "--ckpt-max-failures", type=int_at_least(1), default=3,
        help="checkpoints that may fail in a row (full disk, I/O errors) before the job stops with status 75",
    )
    p.add_argument(
        "--ckpt-timeout", type=positive_float, default=600.0,
        help="seconds the final or a preemption checkpoint may take to commit; else stop with status 75",
    )
    p.add_argument(
        "--ckpt-restore-timeout", type=positive_float, default=600.0,
        help="seconds reading a checkpoint may take on restore; else stop with status 75 (not a restart loop)",
    )
    p.add_argument(
        "--snapshot-every", type=non_negative_int, default=1,
        help="steps between in-memory snapshots under torchrevive-run, which a failure resumes from (0: off)",
    )
    p.add_argument("--collective-timeout", type=positive_float, default=300.0, help="seconds before a collective fails")
    p.add_argument(
        "--term-grace", type=positive_float, default=15.0,
        help="after SIGTERM, seconds to reach the end of the step and checkpoint; else exit at once (blocked)",
    )
    p.add_argument(
        "--hang-timeout", type=non_negative_float, default=300.0,
        help="exit (status 124) when no step completes for this long, so torchrun restarts the group (0: off)",
    )


class ArgumentParser(OneLineArgumentParser):
    """An argument parser that already holds the runtime flags (`add_runtime_arguments`)
    and reports a bad value in one line with exit status 2; a script adds its own flags."""

    def __init__(self, *args: Any, ckpt_every: int = 50, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        add_runtime_arguments(self, ckpt_every=ckpt_every)
