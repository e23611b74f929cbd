"""`torchrevive-run`'s own settings, in one place: each a flag with help, a default and an environment form.

    torchrevive-run --survivors keep --nnodes 2:4 ... train.py      # the flag
    TORCHREVIVE_SURVIVORS=keep torchrevive-run --nnodes 2:4 ...     # its environment form

`SETTINGS` is the one source: `add_arguments` puts them in torchrun's parser (a
group of their own, so `torchrevive-run --help` shows torchrun's flags and
ours), `resolve` reads each from its flag, else its environment form, checks it
(`UsageError`, one line, exit 2, naming the flag or the variable that was
wrong) and writes the value chosen into the agent's environment, from where
the agent's modules and the workers it starts read it as before. docs/reference.md's
launcher table is `flag_table()`, checked by a test.

A setting with no flag is environment-only on purpose: the snapshot secret
itself would be in `ps` and in torchrun's log on a command line (as a password
in --rdzv-conf would: the launcher refuses that too); give a file instead.

Internal plumbing (`INTERNAL`) is not a setting: the agent sets those variables
for its workers, or for the fork server, and overwrites whatever a user set.

Timeouts that stay constants, and why (a user has no better value to give):
- `reaper` scans every 0.25 s; `exit_barrier` polls every 0.05 s; stop_signals
  retries every 0.05 s: poll intervals, the cost of a wake-up against latency.
- `keeper.SnapshotKeeper.close` waits up to 300 s for the newest snapshot to
  reach the checkpoint directory: the same bound as torch's exit barrier, and
  one a stop that must be quicker (Slurm's KillWait) cuts short anyway.
- `keeper_endpoint.HEADER_SECONDS` (20 s) and its 60 s stalled-connection limit,
  `peer_auth.WINDOW` (120 s), `keeper_files.STALE_SECRET` (1 h): protocol bounds
  that peers must agree on; a per-node choice would break the agreement.
- `requeue.DUPLICATE_SIGTERM_WINDOW` (2 s), `slurm.control.SCONTROL_TIMEOUT` (20 s):
  Slurm's own behaviour, measured, not chosen.
- The rendezvous' timeouts (`last_call_timeout`, `keep_alive_*`, `join_timeout`, etcd's
  `read_timeout` and `ttl`) are already settings: `--rdzv-conf` key=value, which wins
  over the defaults in `elastic._shared.protocol.recovery_defaults`; the etcd client's
  retry bounds (`etcd_client.MAX_ATTEMPT_SECONDS`...) divide that `read_timeout`.
- The workers' waits (`--heal-wait`, `--collective-timeout`, `--hang-timeout`,
  `--term-grace`, ...) are the training script's flags (`elastic._worker.config.RunConfig`).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from elastic._agent.launcher import failure_policy
from elastic._agent.launcher.keeper_endpoint import HOST_ENV
from elastic._agent.launcher.keeper_files import BASE_ENV
from elastic._agent.launcher.warm_start import (
    AGENT_PID_ENV,
    DEFAULT_PRELOAD,
    FORK_SERVER_PRELOAD_ENV,
    PRELOAD_ENV,
    TARGET_ENV,
)
from elastic._shared.common.errors import UsageError
from elastic._shared.protocol import heal_env
from elastic._shared.protocol.recovery_defaults import FRESH_STORE_ENV
from elastic._shared.protocol.round_identity import ROUND_ENV
from elastic._shared.protocol.worker_notes import NOTES_ENV as NOTES_ENV_WORKERS
from elastic._shared.slurm.requeue import NOTES_ENV, REQUEUE_SIGNAL_ENV
from elastic._shared.storage import job_secret, keeper_address, peer_auth

SNAPSHOTS_ENV = "TORCHREVIVE_SNAPSHOTS"
"""1 (default): a snapshot keeper per node; 0: none (the workers checkpoint to disk only)."""

PROG = "torchrevive-run"
GROUP_TITLE = "torchrevive-run settings"


@dataclass(frozen=True)
class Setting:
    """One of the launcher's settings. `parse` takes the text given (flag or variable) and returns its
    environment form, or raises `ValueError` with what is wrong (said after the flag or the variable)."""

    name: str
    """The attribute argparse gives it (`survivors`); the flag is `--` and the name with dashes."""
    env: str
    default: str
    """As shown in the help and docs (the value taken when neither the flag nor the variable is set)."""
    help: str
    parse: Callable[[str], str]
    metavar: str
    flag_given: bool = True
    """False: environment only (see the module docstring)."""

    @property
    def flag(self) -> str | None:
        return "--" + self.name.replace("_", "-") if self.flag_given else None


def _choice(*choices: str, fold: Callable[[str], str] = str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = fold(text.strip())
        if value not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return value

    return parse


def _seconds(low: float, high: float) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low <= value <= high:
            raise ValueError(f"is not a number of seconds from {low:g} to {high:g}")
        return text.strip()

    return parse


def _count(low: int, high: int) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip()
        if not (value.isascii() and value.isdigit() and low <= int(value) <= high):
            raise ValueError(f"is not a whole number from {low} to {high}")
        return str(int(value))

    return parse


def _on_off(text: str) -> str:
    value = text.strip().lower()
    if value in ("1", "on", "yes", "true"):
        return "1"
    if value in ("0", "off", "no", "false"):
        return "0"
    raise ValueError("is not 1 (on) or 0 (off)")


def _nonempty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text.strip():
            raise ValueError(f"is empty: give {what}")
        return text

    return parse


def _file(text: str) -> str:
    if not os.path.isfile(text):
        raise ValueError("is not a file")
    return text


def _modules(text: str) -> str:
    """Comma-separated module names, or empty (warm starts off); warm_start checks each can be imported."""
    return ",".join(name.strip() for name in text.split(",") if name.strip())


def _signal(text: str) -> str:
    value = text.strip().upper().removeprefix("SIG")
    if value == "NONE":
        return "none"
    if value not in ("USR1", "USR2"):
        raise ValueError("is not USR1, USR2 or none")
    return value


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "survivors", heal_env.SURVIVORS_ENV, heal_env.RESTART,
        "What a worker's death does to the others: restart: every worker restarts through a new round and "
        "restores (bit-identical); keep: the others keep their processes and wait for its replacement "
        "(a heal in place; the c10d rendezvous); train-on: the others train on at a smaller world size "
        "until the replacement joins (needs --rdzv-id).",
        _choice(*heal_env.MODES), "{" + ",".join(heal_env.MODES) + "}",
    ),
    Setting(
        "frozen_worker_seconds", heal_env.FROZEN_AFTER_ENV, f"{heal_env.DEFAULT_FROZEN_AFTER:g}",
        "With --survivors keep or train-on: seconds a worker may stay stopped (SIGSTOP, a frozen host) "
        "before its agent ends it and replaces it in place; its peers wait on it meanwhile.",
        _seconds(0.5, 86400), "S",
    ),
    Setting(
        "snapshots", SNAPSHOTS_ENV, "1",
        "1: a snapshot keeper per node holds the workers' in-memory snapshots, serves them to peers "
        "and writes the newest to the checkpoint directory at the end; 0: none (checkpoints on disk only).",
        _on_off, "{1,0}",
    ),
    Setting(
        "snapshot_base", BASE_ENV, "/dev/shm",
        "Where the keeper keeps snapshots (a directory of this user's is made under it); "
        "/dev/shm is memory, the system's temporary directory when /dev/shm is not writable.",
        _nonempty("a directory"), "DIR",
    ),
    Setting(
        "snapshot_host", HOST_ENV, "unset",
        "The address the keeper binds and peers reach it by; unset: --local-addr, else the address "
        "this host reaches the rendezvous endpoint from.",
        _nonempty("an address"), "ADDR",
    ),
    Setting(
        "snapshot_secret_file", peer_auth.SECRET_FILE_ENV, "unset",
        "A file holding the job's secret (16 to 4096 bytes) that signs every value the agents and workers read "
        "from the rendezvous and worker stores, and the snapshot traffic; every node needs the same one. Unset "
        "(and no TORCHREVIVE_SNAPSHOT_SECRET): one made for the run on this host, enough for a job on one host "
        "(a loopback endpoint, or one node); a job that may span hosts then stops with one line.",
        _file, "PATH",
    ),
    Setting(
        "unsigned", job_secret.UNSIGNED_ENV, "0",
        "1: a job that may span hosts runs without a secret: anyone who reaches its stores can change what its "
        "agents and workers read there (and there are no in-memory snapshots). 0: such a job needs a secret.",
        _on_off, "{1,0}",
    ),
    Setting(
        "snapshot_secret", peer_auth.SECRET_ENV, "unset",
        "The job's secret itself, environment only (on a command line it would be in `ps` and the logs); "
        "the agent moves it to a private file (mode 0600) its workers read, so they never inherit it; "
        "--snapshot-secret-file wins.",
        _nonempty("the secret"), "SECRET", flag_given=False,
    ),
    Setting(
        "snapshot_tls_cert", peer_auth.TLS_CERT_ENV, "unset",
        "With --snapshot-tls-key: the keeper serves snapshots over TLS with this certificate "
        "(signing authenticates peers either way; TLS also hides the weights on the wire).",
        _file, "PATH",
    ),
    Setting(
        "snapshot_tls_key", peer_auth.TLS_KEY_ENV, "unset",
        "The private key of --snapshot-tls-cert.", _file, "PATH",
    ),
    Setting(
        "snapshot_tls_ca", peer_auth.TLS_CA_ENV, "system CAs",
        "The CA (the job's own) that the workers check the keepers' certificates against.", _file, "PATH",
    ),
    Setting(
        "preload", PRELOAD_ENV, ",".join(DEFAULT_PRELOAD),
        "Modules the fork server imports once, so that workers start warm (comma-separated); "
        "empty: workers start cold, as under torchrun.",
        _modules, "MODULES",
    ),
    Setting(
        "set_aside_failures", failure_policy.SET_ASIDE_FAILURES_ENV, failure_policy.DEFAULTS[failure_policy.SET_ASIDE_FAILURES_ENV],
        "A node whose workers fail first (or are named by a hang) this many times within --set-aside-window, "
        "while no other node fails as often, is set aside: its agent leaves the job with one line (exit "
        f"status {failure_policy.SET_ASIDE_EXIT}) and the others train on within --nnodes MIN; 0: never.",
        _count(0, 1000), "K",
    ),
    Setting(
        "set_aside_window", failure_policy.SET_ASIDE_WINDOW_ENV, failure_policy.DEFAULTS[failure_policy.SET_ASIDE_WINDOW_ENV],
        "Seconds within which --set-aside-failures are counted.", _seconds(1, 30 * 86400), "S",
    ),
    Setting(
        "set_aside_cool_off", failure_policy.SET_ASIDE_COOL_OFF_ENV, failure_policy.DEFAULTS[failure_policy.SET_ASIDE_COOL_OFF_ENV],
        "Seconds a set-aside node's host waits before an agent started there joins the job again.",
        _seconds(0, 30 * 86400), "S",
    ),
    Setting(
        "crash_loop_attempts", failure_policy.CRASH_LOOP_ATTEMPTS_ENV, failure_policy.DEFAULTS[failure_policy.CRASH_LOOP_ATTEMPTS_ENV],
        "A failure that repeats after the same completed step this many times in a row, with no step completed "
        f"past it, stops the job with one line and exit status {failure_policy.CRASH_LOOP_EXIT} (final: not restarted, "
        "not requeued) instead of spending --max-restarts; 0: never.",
        _count(0, 1000), "R",
    ),
    Setting(
        "requeue_signal", REQUEUE_SIGNAL_ENV, "USR1",
        "In a Slurm job: the signal (sbatch --signal) on which the agents stop the workers, which "
        "commit a checkpoint, and rank 0's agent requeues the job; none: no requeue.",
        _signal, "{USR1,USR2,none}",
    ),
)

BY_NAME = {setting.name: setting for setting in SETTINGS}

INTERNAL: dict[str, str] = {
    heal_env.HEAL_STORE_ENV: "the agent, for its workers: host:port of the rendezvous store where heals meet",
    heal_env.HEAL_NAMESPACE_ENV: "the agent, for its workers: this round's namespace in that store",
    heal_env.HEAL_GENERATION_ENV: "the agent, for its workers: the heal generation (train-on: incarnation) they start in",
    heal_env.MIN_WORLD_ENV: "the agent, for its workers: torchrun's minimum of nodes times the workers per node",
    keeper_address.ROOT_ENV: "the agent, for its workers: the keeper's directory in node memory",
    keeper_address.URL_ENV: "the agent, for its workers: the keeper's endpoint",
    keeper_address.NODE_ENV: "the agent, for its workers: the keeper's node name",
    TARGET_ENV: "the agent, for the fork server: the script or module the warm workers run",
    AGENT_PID_ENV: "the agent, for the fork server: the agent it dies with",
    FORK_SERVER_PRELOAD_ENV: "the agent, for the fork server only (taken out before a worker starts)",
    NOTES_ENV: "the agent, for its workers in a Slurm job: where they note their last commit for the requeue",
    FRESH_STORE_ENV: "torch's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE): the agent sets 1 unless the user chose",
    NOTES_ENV_WORKERS: "the agent, for its workers: where they note their last step, a named hang and the event log's path",
    ROUND_ENV: "the agent, for its workers: the launch and rendezvous round they start in (their worker store's seal)",
}
"""Variables the agent sets for its workers or its fork server: plumbing, not settings (who sets each, and why).
A user who sets one is overridden. The chaos tooling's ELASTIC_FAULT, ELASTIC_FAULT_ONCE_DIR and
ELASTIC_SAMPLE_LOG are test inputs of `elastic.chaos` (docs/chaos.md), not settings of a job."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Our flags, in a group of their own in torchrun's parser. Their argparse default is None:
    `resolve` then falls back to the environment form."""
    group = parser.add_argument_group(
        GROUP_TITLE,
        "torchrevive-run's own flags. Each has an environment form, taken when the flag is not given; "
        "the flag wins. An invalid value ends the launcher with one line, exit status 2.",
    )
    for setting in SETTINGS:
        if setting.flag is not None:
            group.add_argument(
                setting.flag, dest=setting.name, default=None, metavar=setting.metavar,
                help=f"{setting.help} (env {setting.env}; default: {setting.default})".replace("%", "%%"),
            )


def resolve(args: argparse.Namespace, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Each setting from its flag in `args`, else from `environ`; checked, then written to `environ` in its
    environment form (whence the agent's modules and its workers read it). Returns the settings chosen
    (flag or variable; the others keep their defaults and stay unset). `UsageError` (one line) naming the
    flag or the variable for an invalid value, before anything is written. Takes our flags out of `args`."""
    chosen: dict[str, str] = {}
    for setting in SETTINGS:
        given = getattr(args, setting.name, None)
        if setting.flag is not None and hasattr(args, setting.name):
            delattr(args, setting.name)  # torch's run never sees our flags
        if given is not None:
            where, text = f"{setting.flag} {given!r}", given
        elif environ.get(setting.env) is not None:
            where, text = f"{setting.env}={environ[setting.env]!r}", environ[setting.env]
            if text == "" and setting.env != PRELOAD_ENV:  # an empty preload is a choice: warm starts off
                continue  # any other empty variable is as good as unset (as before)
        else:
            continue
        try:
            chosen[setting.name] = setting.parse(text)
        except ValueError as error:
            raise UsageError(f"{where} {error}") from None
    _check_together(chosen)
    for name, value in chosen.items():
        environ[BY_NAME[name].env] = value
    return chosen


def _check_together(chosen: Mapping[str, str]) -> None:
    if ("snapshot_tls_cert" in chosen) != ("snapshot_tls_key" in chosen):
        given, missing = (("--snapshot-tls-cert", "--snapshot-tls-key") if "snapshot_tls_cert" in chosen
                          else ("--snapshot-tls-key", "--snapshot-tls-cert"))
        raise UsageError(f"{given} needs {missing} too ({peer_auth.TLS_CERT_ENV} and {peer_auth.TLS_KEY_ENV})")


def flag_table() -> str:
    """The markdown table of the launcher's settings (docs/reference.md)."""
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for setting in SETTINGS:
        flag = f"`{setting.flag} {setting.metavar}`" if setting.flag else "(environment only)"
        rows.append(f"| {flag} | `{setting.env}` | {setting.default} | {setting.help} |")
    return "\n".join(rows) + "\n"


def internal_table() -> str:
    """The markdown table of the internal variables (docs/reference.md)."""
    rows = ["| variable | set by, for |", "|---|---|"]
    rows += [f"| `{name}` | {why} |" for name, why in INTERNAL.items()]
    return "\n".join(rows) + "\n"
