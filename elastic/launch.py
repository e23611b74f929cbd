"""`python -m elastic.launch` (or `torchrevive-run`): torchrun with recovery-friendly defaults.

It is torchrun: it takes every torchrun flag (torch's own parser reads the
command line) and runs torch's own launcher. It only changes defaults the user
did not set:

- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`. Stock torchrun keeps one worker store
  for the whole job and, since the workers of every round write their gloo
  addresses under the same keys, the workers of a new round can read the
  addresses of the previous round's dead workers and fail with `Gloo
  connectFullMesh failed ... Connection refused`: each such failed round costs a
  join timeout and a restart. With a fresh store per round a kill costs exactly
  one clean round.
- `--rdzv-conf` gets `last_call_timeout=2` (torch: 30 s, paid by every round
  once the minimum number of nodes is there), `keep_alive_interval=1` and
  `keep_alive_max_attempt=3` (a node that died is declared dead after about 3 s
  instead of 15 s). Values given in `--rdzv-conf` win.

README ("Recovery settings") explains each trade-off.
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

RECOVERY_RDZV_CONF = {
    "last_call_timeout": "2",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
}
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def merged_rdzv_conf(user_conf: str) -> str:
    """`user_conf` (torchrun's `k=v,k=v`) with our defaults for the keys it lacks."""
    given = [item for item in (user_conf or "").split(",") if item.strip()]
    keys = {item.split("=", 1)[0].strip() for item in given}
    extra = [f"{k}={v}" for k, v in RECOVERY_RDZV_CONF.items() if k not in keys]
    return ",".join(given + extra)


# Exit statuses the runtime gives its workers, for the failure summary.
_KNOWN_EXITS = {124: "the hang watchdog (no step completed in --hang-timeout)", 143: "SIGTERM (preemption)"}


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}" + (f", {_KNOWN_EXITS[exitcode]}" if exitcode in _KNOWN_EXITS else "")


def failure_summary(error: ChildFailedError, max_restarts: int) -> str:
    """One line for the end of a failed job: who failed first, how, and that the
    restarts are used up (the checkpoints already committed stay as they are)."""
    rank, failure = error.get_first_failure()
    return (
        f"torchrevive-run: job failed: worker rank {rank} {describe_exit(failure.exitcode)}, "
        f"and this agent has used up --max-restarts={max_restarts}; committed checkpoints are kept, "
        "run the job again to resume from the newest one"
    )


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.rdzv_conf = merged_rdzv_conf(args.rdzv_conf)
    os.environ.setdefault(FRESH_STORE_ENV, "1")
    try:
        record(run)(args)  # torch's own report of the failure comes first
    except ChildFailedError as error:
        print(failure_summary(error, args.max_restarts), file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
