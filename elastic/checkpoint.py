"""`python -m elastic.checkpoint inspect DIR`: list checkpoints and verify each one.

DIR is a directory or a bucket prefix (`s3://BUCKET/PREFIX`, credentials from
the environment: docs/object-storage.md).

Exit status: 0 when at least one checkpoint verifies (a job would resume from
the newest of those), 1 when none does, 2 on bad usage (no such directory, a
bucket that cannot be read).
Reading only: nothing in DIR is changed, corrupt checkpoints included.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from elastic._shared.common.cli import OneLineArgumentParser, run_main
from elastic._shared.common.errors import CheckpointError, CorruptCheckpoint, UsageError
from elastic._shared.storage.location import is_url
from elastic._shared.storage.stores import open_store


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def inspect(directory: str) -> int:
    if not is_url(directory) and not Path(directory).is_dir():
        raise UsageError(f"{directory} is not a directory")
    store = open_store(directory)
    candidates = store.committed()
    if not candidates:
        raise CheckpointError(f"{directory} holds no committed checkpoint")
    header = f"{'checkpoint':<16}{'step':>9}{'epoch':>7}{'consumed':>10}{'world':>7}{'size':>11}  {'saved':<20}{'reason':<12}status"
    print(header)
    good = 0
    for candidate in candidates:
        try:
            manifest = store.verify(candidate)
        except CorruptCheckpoint as exc:
            print(f"{candidate.name:<16}{candidate.step:>9}{'?':>7}{'?':>10}{'?':>7}{'?':>11}  {'?':<20}{'?':<12}CORRUPT: {exc}")
            continue
        good += 1
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created))
        print(
            f"{candidate.name:<16}{manifest.step:>9}{manifest.epoch:>7}{manifest.consumed:>10}"
            f"{manifest.world_size:>7}{_size(manifest.total_bytes):>11}  {saved:<20}{manifest.reason:<12}ok"
        )
    print(f"latest -> {store.latest_pointer() or '(none)'}; {good} of {len(candidates)} verify")
    if good == 0:
        raise CheckpointError(f"no checkpoint in {directory} verifies")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m elastic.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect_cmd = commands.add_parser("inspect", help="list checkpoints and verify each one")
    inspect_cmd.add_argument("directory", help="a checkpoint directory, or s3://BUCKET/PREFIX")
    args = parser.parse_args(argv)
    return inspect(args.directory)


if __name__ == "__main__":
    sys.exit(run_main(main))
