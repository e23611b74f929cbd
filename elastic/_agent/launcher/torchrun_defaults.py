"""The launcher's defaults for torchrun's own flags: what `torchrevive-run` changes of torch's parser.

Each default applies only where the user chose nothing (neither the flag nor its PET_ variable):

- `--max-restarts` 100 (`MAX_RESTARTS`), said in its help: torchrun's 0 ends a job at its first failure;
- `--rdzv-backend` c10d for a range of nodes (`range_backend`): torchrun's static waits for MAX of them;
- `--start-method` and `--nnodes` left unset (None), so that the warm start and the Slurm launch can tell
  torch's defaults from a choice.

The other recovery defaults (the rendezvous' timeouts, a fresh store per round) are in
elastic._shared.protocol.recovery_defaults; `torchrevive-run`'s own settings in settings.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping


MAX_RESTARTS = 100
"""`--max-restarts` when neither the flag nor PET_MAX_RESTARTS is given. torchrun's 0 ends the job at its
first failure and turns every heal in place off (a heal spends a restart, as torch's would). A large number
is safe: what must not restart is stopped by rules of its own (a crash loop: --crash-loop-attempts; a node
that keeps failing: --set-aside-failures; bad input and failing storage: exit 2 and 75, final). And every
agent spends one on almost any failure (its workers' collectives break too), so a long job needs many."""


def apply(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """torchrun's parser with the launcher's own defaults: `--max-restarts` (`MAX_RESTARTS`, said in its help),
    and `start_method` / `nnodes` None when neither the flag nor PET_START_METHOD / PET_NNODES chose one (the
    warm start and the Slurm launch tell torch's defaults from a choice). A PET_ variable still wins, as in torch."""
    parser.set_defaults(start_method=environ.get("PET_START_METHOD"), nnodes=environ.get("PET_NNODES"))
    if environ.get("PET_MAX_RESTARTS") is None:
        parser.set_defaults(max_restarts=MAX_RESTARTS)
    for action in parser._actions:  # argparse keeps no public handle on an added argument's help
        if action.dest == "max_restarts":
            action.help = (f"Maximum number of worker group restarts before failing (torchrevive-run: {MAX_RESTARTS}; "
                           "torchrun's 0 ends the job at the first failure and turns every heal off; crash loops and "
                           "bad nodes are stopped by --crash-loop-attempts and --set-aside-failures instead).")


def max_nodes(args: argparse.Namespace) -> int:
    """The most nodes `--nnodes` allows (1 when it cannot be read: torch reports that itself)."""
    text = str(getattr(args, "nnodes", None) or "1")
    try:
        return int(text.split(":")[-1])
    except ValueError:
        return 1


def range_backend(args: argparse.Namespace, argv: list[str], environ: Mapping[str, str]) -> None:
    """`--nnodes MIN:MAX` (MIN < MAX) with no `--rdzv-backend` (nor PET_RDZV_BACKEND) takes c10d: torchrun's
    default, static, cannot serve a range of nodes (its first node waits for MAX of them, for ever), so a
    line that names an endpoint and a range but no backend (as the docs' Hugging Face lines did) hung."""
    ours = argv[: len(argv) - len(getattr(args, "training_script_args", []) or []) - 1]  # the launcher's, not the script's
    chosen = environ.get("PET_RDZV_BACKEND") or any(a.split("=")[0] in ("--rdzv-backend", "--rdzv_backend") for a in ours)
    low, _, high = str(getattr(args, "nnodes", None) or "1").partition(":")
    if not chosen and args.rdzv_backend == "static" and high and low != high and not args.standalone:
        args.rdzv_backend = "c10d"
