"""`python -m elastic._agent.launcher` (or `torchrevive-run`): torchrun with recovery-friendly defaults.

It is torchrun: it takes every torchrun flag (torch's own parser reads the
command line, torch's `config_from_args` turns it into torch's launch config) and
runs torch's agent, as the subclass `elastic._agent.launcher.revive_agent.ReviveAgent`
that the module's `launch_agent` builds as torch's own would. Its own settings (`--survivors`,
the snapshot keeper's, ...) are flags in the same parser, each with an
environment form (`elastic._agent.launcher.settings`, which `--help` lists
after torchrun's flags). It only changes defaults the user did not set:

- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`. Stock torchrun keeps one worker store
  for the whole job, hosted by the first round's rank-0 agent: a node that
  joins after the first round (a scale-up, a replaced node) waits for a store
  address nobody publishes and the rendezvous times out. (The dead round's gloo
  addresses that the shared store also keeps are harmless to our workers:
  `elastic._worker.runtime.round_store` gives every round a namespace of its own.)
  A fresh store per round also spares the handshake.
- `--rdzv-conf` gets `last_call_timeout=2` (torch: 30 s, paid by every round
  once the minimum number of nodes is there), `keep_alive_interval=1` and
  `keep_alive_max_attempt=3` (a node that died is declared dead after about 3 s
  instead of 15 s). Values given in `--rdzv-conf` win.
- Workers start warm (`elastic._agent.launcher.warm_start`): forked from a fork server that
  imported torch once per agent, instead of a fresh `python -u script.py`
  that imports torch on every restart. This is torchrun's own
  `--start-method=forkserver` and `--run-path`; `--no-python`, a
  `--start-method` other than forkserver, `PYTHON_EXEC`, or
  `--preload ''` (TORCHREVIVE_PRELOAD=) keep torch's way.

Each node gets a snapshot keeper (`elastic._agent.launcher.keeper`): the process
side of the memory tier, which holds the workers' in-memory snapshots in
/dev/shm, serves them to peer nodes, and writes the newest one to the
checkpoint directory when the workers stop. `--snapshots 0` (TORCHREVIVE_SNAPSHOTS=0) leaves
it out (the workers then checkpoint to disk only, as under plain torchrun).

Every rendezvous handler comes from `elastic._agent.rendezvous.handlers` (`--rdzv-backend c10d` is
its `c10d-sealed`): every value the agents read from the rendezvous is sealed with the job's secret
(elastic._shared.storage.job_secret: given, or made on the host for a job on one host; a job that may
span hosts without one stops here in one line unless `--unsigned`); under Slurm the first node takes
the store's port before anything else starts.

It also imports torch._dynamo in the agent at start (torch's log formatter
imports it when the agent first logs a worker's traceback: 1-3 s on the first
recovery's path), ends the job instead of restarting it when a worker exits
with status 75 (checkpoint storage refuses writes: a restart would meet the
same storage) or 2 (bad input: a restart would meet the same input), runs
the stopped-worker reaper (`elastic._agent.launcher.reaper`: a stopped
worker cannot act on the SIGTERM that stops its group, and torch would wait
30 s before SIGKILL), and a script path that does not exist fails at once with
one line instead of in every worker of every restart.

docs/recovery.md ("Recovery settings") explains each trade-off.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastic._agent.launcher import (
    in_place,
    job_entries,
    job_watch,
    revive_agent,
    set_aside_mark,
    settings,
    slurm_launch,
    torchrun_defaults,
    warm_start,
)
from elastic._agent.launcher.keeper import SnapshotKeeper
from elastic._agent.launcher.keeper_endpoint import keeper_host
from elastic._agent.launcher.reaper import start_reaper
from elastic._agent.rendezvous import handlers, quick_rounds, worker_port
from elastic._shared.common.errors import CheckpointStorageError, UsageError
from elastic._shared.common.slow_imports import prefetch_slow_imports
from elastic._shared.protocol.heal_env import HEAL_FAILED_EXIT
from elastic._shared.protocol.recovery_defaults import FRESH_STORE_ENV, merged_rdzv_conf
from elastic._shared.storage import job_secret, peer_auth

SNAPSHOTS_ENV = settings.SNAPSHOTS_ENV

# Exit statuses the runtime gives its workers, for the failure summary.
STORAGE_EXIT = CheckpointStorageError.exit_code
USAGE_EXIT = UsageError.exit_code
_KNOWN_EXITS = {
    USAGE_EXIT: "bad input (a flag, a variable, a file)",
    124: "the hang watchdog (no step completed in --hang-timeout)",
    143: "SIGTERM (preemption)",
    STORAGE_EXIT: "checkpoint storage refuses writes",
    HEAL_FAILED_EXIT: "a heal in place that did not form (TORCHREVIVE_SURVIVORS=keep or train-on)",
}
# Exits a restart cannot fix: the agent stops instead of training into the same failure.
FINAL_EXITS = frozenset({USAGE_EXIT, STORAGE_EXIT})
_WHAT_TO_FIX = {USAGE_EXIT: "input", STORAGE_EXIT: "storage"}


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
    if failure.exitcode in FINAL_EXITS:
        what = _WHAT_TO_FIX[failure.exitcode]
        return (
            f"torchrevive-run: job stopped: worker rank {rank} {describe_exit(failure.exitcode)} (its log says why); "
            f"not restarted, since a restart would meet the same {what}; committed checkpoints are intact, "
            f"fix the {what} and run the job again to resume from the newest one"
        )
    return (
        f"torchrevive-run: job failed: worker rank {rank} {describe_exit(failure.exitcode)}, "
        f"and this agent has used up --max-restarts={max_restarts}; committed checkpoints are kept, "
        "run the job again to resume from the newest one"
    )


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # Our flags, else their environment forms: checked, then in the environment the agent's
        # modules and its workers read them from (one line and exit 2 for an invalid value).
        settings.resolve(args, os.environ)
        requeue = slurm_launch.RequeueSignal(os.environ)  # first: Slurm may send it any time from now
        check_rdzv_conf(args)
        hosted_port = slurm_launch.expand_endpoint(args, os.environ, nnodes_given=args.nnodes is not None)
        if hosted_port is not None:
            slurm_launch.hold_store_port(hosted_port)  # before anyone else can listen there
        if args.nnodes is None:
            args.nnodes = "1:1"  # torchrun's default
        preload = warm_start.preload_modules()
        in_place.check_setting(os.environ, args)  # TORCHREVIVE_SURVIVORS: one of its choices, or one line, exit 2
        check_script(args)
        settle_standalone(args)  # the run id the keeper and the secret are for must be the workers' from the start
        handlers.launcher_backend(args)  # c10d is c10d-sealed: every value its agents read is sealed
        secret = signing_secret(args)
        frozen_after = in_place.frozen_after(os.environ) if in_place.enabled(os.environ) else None
    except UsageError as error:
        print(f"torchrevive-run: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    # torch's log formatter imports torch._dynamo (1-3 s) the first time the agent
    # logs a worker's traceback: on the path of the first recovery unless done now.
    prefetch_slow_imports()
    # A stopped worker would cost each restart torch's 30 s SIGTERM wait; with heals in place, one
    # stopped `frozen_after` seconds is ended and replaced (its peers wait on it in a collective).
    start_reaper(frozen_after=frozen_after)
    args.rdzv_conf = merged_rdzv_conf(args.rdzv_conf)
    os.environ.setdefault(FRESH_STORE_ENV, "1")
    notes = job_entries.make_notes_directory()  # where the workers note their step, a named hang, the event log
    handlers.register()  # our rendezvous backends in torch's registry (the entry points do it too)
    worker_port.install()  # each round's worker store on a port no other socket is handed meanwhile
    set_aside_mark.wait_out_cool_off(os.environ, getattr(args, "rdzv_id", None) or "none")  # this host set aside?
    keeper = start_keeper(args, secret)  # before the fork server starts: its workers inherit where it is
    stopped_by: signal.Signals | None = None
    try:
        requeue.launching()  # raises the stop now if the requeue signal came already
        record(launch)(args, preload, keeper)  # torch's own report of the failure comes first
    except ChildFailedError as error:
        print(failure_summary(error, args.max_restarts), file=sys.stderr, flush=True)
        _, failure = error.get_first_failure()
        requeue.close()
        sys.exit(failure.exitcode if failure.exitcode in FINAL_EXITS else 1)
    except (job_watch.NodeSetAside, job_watch.CrashLoopStop) as decided:  # the job's failures decided it
        # (a crash loop another agent stopped reaches this one as its line: revive_agent.launch_agent)
        print(f"torchrevive-run: {decided.line}", file=sys.stderr, flush=True)
        requeue.close()
        sys.exit(decided.exit_code)
    except RendezvousClosedError:  # closed, and not on a crash loop
        requeue.close()
        raise
    except UsageError as error:  # met in the rendezvous: e.g. a signed state and no secret (state_seal)
        print(f"torchrevive-run: error: {error}", file=sys.stderr, flush=True)
        requeue.close()
        sys.exit(error.exit_code)
    except SignalException as stop:  # SIGTERM, SIGINT... or the requeue signal: the workers were stopped
        stopped_by = stop.sigval
        # Leaving now: another SIGTERM (Slurm ending the step) must not raise into the exit's handlers.
        for each in (signal.SIGTERM, signal.SIGINT, requeue.signum):
            if each is not None:
                signal.signal(each, signal.SIG_IGN)
    finally:
        if keeper is not None:
            keeper.close()  # the newest snapshot is persisted before the agent leaves (and before a requeue)
        shutil.rmtree(notes, ignore_errors=True)
    try:
        if stopped_by is not None:
            name = "the Slurm requeue signal" if requeue.received else stopped_by.name
            told = ("the workers were told to commit this step and leave" if stopped_by == signal.SIGTERM
                    else "the workers were stopped; committed checkpoints are kept")  # they commit on SIGTERM only
            print(f"torchrevive-run: stopped by {name}; {told}", file=sys.stderr, flush=True)
            line = requeue.requeue_if_first()
            if line is not None:
                print(f"torchrevive-run: {line}", file=sys.stderr, flush=True)
    finally:
        requeue.close()
    if stopped_by is not None:
        sys.exit(128 + int(stopped_by))


def signing_secret(args: argparse.Namespace) -> job_secret.JobSecret:
    """The job's secret (elastic._shared.storage.job_secret), named in the environment the keeper, the
    rendezvous handlers and the workers read it from; `UsageError` (one line) when it cannot be had."""
    run_id = getattr(args, "rdzv_id", None) or "none"
    try:
        return job_secret.resolve(run_id, endpoint=getattr(args, "rdzv_endpoint", None), max_nodes=torchrun_defaults.max_nodes(args))
    except peer_auth.SecretError as exc:
        raise UsageError(str(exc)) from None


def start_keeper(args: argparse.Namespace, secret: job_secret.JobSecret) -> SnapshotKeeper | None:
    """This node's snapshot keeper, its address in the environment the workers inherit (the agent
    tells it whenever it stops its workers: `ReviveAgent`); None when TORCHREVIVE_SNAPSHOTS=0, the job is
    unsigned, or it cannot start (one warning line: the job then checkpoints to disk only).

    Its traffic is signed with the job's `secret`; a secret this host made (`secret.made_here`) is
    removed by the run's last keeper on the host."""
    if os.environ.get(SNAPSHOTS_ENV, "1") == "0":
        return None
    if secret.key is None:
        print("torchrevive-run: warning: no in-memory snapshots on this node: an unsigned job's keepers could not "
              "tell its snapshot traffic from a stranger's; checkpoints go to disk only", file=sys.stderr, flush=True)
        return None
    run_id = getattr(args, "rdzv_id", None) or "none"
    try:
        keeper = SnapshotKeeper(
            keeper_host(getattr(args, "local_addr", None), getattr(args, "rdzv_endpoint", None)),
            key=secret.key, run_id=run_id, tls=peer_auth.server_tls(os.environ), secret_file=secret.made_here,
        )
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"torchrevive-run: warning: no in-memory snapshots on this node: the snapshot keeper cannot start "
              f"({why}); checkpoints go to disk only", file=sys.stderr, flush=True)
        return None
    os.environ.update(keeper.address.environ())
    return keeper


def settle_standalone(args: argparse.Namespace) -> None:
    """`--standalone` as torch's `run` would expand it (a c10d store on localhost, a fresh run id),
    done here so that the snapshot keeper, started first, knows the run id its workers get."""
    if getattr(args, "standalone", False):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
        args.standalone = False


def check_rdzv_conf(args: argparse.Namespace) -> None:
    """A `quick_rounds` that is not a boolean is refused here, in one line (torch's handler would raise
    in every agent). A password inside --rdzv-conf is refused here, before torch's agent logs its rendezvous
    options (it logs them verbatim at INFO); the rendezvous refuses it too, for plain torchrun."""
    for item in (getattr(args, "rdzv_conf", None) or "").split(","):
        name, _, value = (part.strip() for part in item.partition("="))
        if name == quick_rounds.QUICK_ROUNDS_CONF and value.lower() not in quick_rounds.BOOLEANS:
            raise UsageError(f"--rdzv-conf {name}={value!r}: say 1 (rounds close once every node is back) or 0 "
                             "(torch's rounds)")
        if name.lower() == "password":
            raise UsageError("--rdzv-conf password=... would be in torchrun's log and in `ps`: write the password "
                             "to a file readable only by you and give password_file=PATH instead")


def check_script(args: argparse.Namespace) -> None:
    """A Python script that is not there fails now, once, rather than in every
    worker of every restart."""
    if not (args.module or args.no_python) and not os.path.isfile(args.training_script):
        raise UsageError(f"training script {args.training_script} does not exist")


def args_parser() -> argparse.ArgumentParser:
    """torchrun's own parser, with our settings in a group of their own (`settings.add_arguments`) and our
    defaults (`torchrun_defaults.apply`: `--max-restarts`; `start_method` None when neither the command
    line nor PET_START_METHOD chose one, torch would take spawn; `nnodes` None likewise, torch: 1:1)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = settings.PROG
    parser.description = (
        "torchrun with recovery defaults: every torchrun flag, then torchrevive-run's own settings "
        "(last in this help). docs/recovery.md explains each."
    )
    torchrun_defaults.apply(parser, os.environ)  # --max-restarts that recovers; start method, nnodes unchosen
    settings.add_arguments(parser)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, read by `args_parser` (our settings' flags are still in it: `settings.resolve`
    takes them out), with c10d for a range of nodes and no backend chosen (`torchrun_defaults.range_backend`)."""
    args = args_parser().parse_args(argv)
    torchrun_defaults.range_backend(args, argv, os.environ)
    return args


def launch(args: argparse.Namespace, preload: tuple[str, ...], keeper: SnapshotKeeper | None = None) -> None:
    """What torch's `torch.distributed.run.run` does, with warm worker starts when they apply and our agent
    (`revive_agent.launch_agent`), which tells `keeper` each time it stopped its workers. `--standalone` and
    a one-node static rendezvous were settled before (`settle_standalone`, `handlers.launcher_backend`)."""
    import torch.multiprocessing
    from torch.distributed.run import config_from_args

    if warm_start.applies(args, preload):
        warm_start.configure(args, preload)
    elif args.start_method is None:
        args.start_method = "spawn"  # torch's default
    freeze_long_lived()
    torch.multiprocessing._set_thread_name("pt_elastic")  # as torch's run names the agent's thread
    config, entrypoint, entrypoint_args = config_from_args(args)
    revive_agent.launch_agent(config, entrypoint, entrypoint_args, keeper=keeper, final_exits=FINAL_EXITS)


def freeze_long_lived() -> None:
    """Leave the objects the agent holds from here to its end (torch's, the runtime's: hundreds of
    thousands) out of every later garbage collection. The agent's full collections walked them all,
    about 0.2 s of CPU each, and one fell at a random point of a recovery (traced: inside a
    rendezvous round, where every node waited for it). What the agent makes later is collected as before."""
    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    main()
