"""`python -m elastic.chaos`: run chaos scenarios against the GPT recipe on this machine.

    python -m elastic.chaos --scenario kill-worker --scenario node-loss
    python -m elastic.chaos --scenario all --backend etcd-v3 --endpoint 127.0.0.1:2379

Each scenario starts a fresh job of two torchrun agents (`--nnodes=2:3`, or 1:3
for node-loss and scale-up),
injects its fault once training is under way, waits for the end and prints one
line: exit codes, the step reached, recovery time from the event log, and
whether the final checkpoint verifies. Exit status: 0 when every scenario
passed, 1 when one failed (its agents' logs are kept in --workdir), 2 on usage.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from elastic.chaos.harness import SCENARIOS, run_scenario
from elastic.cli import OneLineArgumentParser, positive_int, run_main
from elastic.errors import ElasticError, UsageError


def build_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m elastic.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--scenario", action="append", choices=[*SCENARIOS, "all"], required=True,
        help="fault to inject (repeatable; 'all' runs every one)",
    )
    p.add_argument("--backend", choices=["c10d", "etcd-v3"], default="c10d")
    p.add_argument("--endpoint", default=None, help="etcd HOST:PORT (etcd-v3)")
    p.add_argument("--launcher", choices=["ours", "stock"], default="ours", help="elastic.launch or plain torchrun")
    p.add_argument("--steps", type=positive_int, default=None, help="steps of each job (default: 40, 200 for node-loss, 400 for scale-up)")
    p.add_argument("--data", default=None, help="text for the recipe (default: this package's own sources)")
    p.add_argument("--workdir", default=None, help="keep jobs' logs, events and checkpoints here (default: temporary)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.backend == "etcd-v3" and not args.endpoint:
        raise UsageError("--backend etcd-v3 needs --endpoint HOST:PORT of a running etcd")
    names = list(SCENARIOS) if "all" in args.scenario else list(dict.fromkeys(args.scenario))
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="elastic-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else root / "corpus.txt"
    if not args.data:
        package = Path(__file__).resolve().parents[1]
        data.write_text("".join(p.read_text() for p in sorted(package.rglob("*.py"))))
    elif not data.is_file():
        raise UsageError(f"--data {data}: no such file")
    failed = 0
    for name in names:
        result = run_scenario(
            name, root / name, data, steps=args.steps, backend=args.backend, endpoint=args.endpoint,
            launcher=args.launcher, seed=args.seed,
        )
        print(result.summary(), flush=True)
        failed += not result.ok
    if failed:
        raise ElasticError(f"{failed} of {len(names)} scenarios failed; logs under {root}")
    print(f"all {len(names)} scenarios passed; logs under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
