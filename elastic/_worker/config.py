"""The runtime's settings, in one place: `RunConfig`, and the flags every recipe takes, made from it.

    parser = elastic.ArgumentParser(prog="train.py", ckpt_every=50)   # the flags; this script's own default
    parser.add_argument("--lr", type=float, default=1e-3)            # the script's own flags
    with elastic.Run.from_args(parser.parse_args()) as run: ...

Each field of `RunConfig` is a setting: its name is the flag (`ckpt_every` is
`--ckpt-every`), its default the flag's default, its docstring the flag's help,
and its rule, declared beside it (`setting`), checks it both as a flag (argparse:
one line, exit 2) and as a keyword (`elastic.Run(ckpt_every=-1)`: one `UsageError`
line). Each field also names its section (run, checkpoint, integrity, observe,
timeouts, slow ranks): `--help` groups the flags so. A
script may choose its own default for a flag, said where it builds its
parser (`add_runtime_arguments(p, ckpt_every=200)`). docs/reference.md's flag
table is `flag_table()`, checked by a test.

This module sits at the bottom of the worker side: it imports only the
command-line helpers, the errors and the parser of checkpoint locations
(storage/location.py, which imports nothing heavy), so every layer can take a `RunConfig`.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import math
import os
import textwrap
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any

from elastic._shared.common.cli import (
    OneLineArgumentParser,
    int_at_least,
    is_steps_or_epochs,
    non_negative_float,
    port_number,
    positive_float,
    steps_or_epochs,
)
from elastic._shared.common.errors import UsageError
from elastic._shared.common.settings_input import as_settings, read_value
from elastic._shared.storage import location

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DEFAULT_METRICS_HOST = "127.0.0.1"
NUMERIC_GUARD_CHOICES = ("off", "stop", "skip", "rollback")
SLOW_RANKS_CHOICES = ("off", "report", "rebalance", "evict")


@dataclass(frozen=True)
class _Rule:
    """What values a setting takes: its flag's parser (one-line errors) and the same check on a keyword."""

    parse: Callable[[str], Any]
    holds: Callable[[Any], bool]
    message: Callable[[str, Any], str]
    metavar: str | None = None
    choices: tuple[str, ...] | None = None


def _at_least(low: int, metavar: str = "N") -> _Rule:
    says = "0 or more" if low == 0 else f"at least {low}"
    return _Rule(
        int_at_least(low), lambda v: isinstance(v, int) and v >= low, lambda n, v: f"{n}={v!r} must be {says}", metavar
    )


_SECONDS_ABOVE_0 = _Rule(
    positive_float, lambda v: isinstance(v, (int, float)) and 0 < v < math.inf,
    lambda n, v: f"{n} must be above 0 (and finite), not {v}", "S",
)
_SECONDS_0_OR_MORE = _Rule(
    non_negative_float, lambda v: isinstance(v, (int, float)) and 0 <= v < math.inf,
    lambda n, v: f"{n} must be 0 or more (and finite), not {v}", "S",
)


def _snapshot_every(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int_at_least(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto or a number of steps, 0 or more") from None


_SNAPSHOT_EVERY = _Rule(
    _snapshot_every, lambda v: v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    lambda n, v: f"{n}={v!r} must be auto or a number of steps, 0 or more", "N",
)
_REPLICA_CHECK_EVERY = _SNAPSHOT_EVERY  # the same rule: auto, or a number of steps (0: off)
_CKPT_EVERY = _Rule(
    steps_or_epochs, is_steps_or_epochs,
    lambda n, v: f"{n}={v!r} must be a number of steps, 0 or more, or of epochs (2e: every second epoch's end)", "N|Ne",
)


def _factor_above_1(text: str) -> float:
    value = positive_float(text)
    if not value > 1:
        raise argparse.ArgumentTypeError(f"{value} must be above 1")
    return value


_SECONDS_ABOVE_0_HOURS = _Rule(
    positive_float, _SECONDS_ABOVE_0.holds, lambda n, v: f"{n} must be above 0 (and finite), not {v}", "H",
)
_PATH = _Rule(str, lambda v: v is None or isinstance(v, str), lambda n, v: f"{n}={v!r} is not a path", "PATH")


def _checkpoint_location(text: str) -> str:
    """A directory, or a supported bucket URL: any other `SCHEME://` is refused, never taken for a path."""
    try:
        location.check(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _location_holds(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    try:
        location.check(value)
    except UsageError:
        return False
    return True


def _location_message(name: str, value: Any) -> str:
    if isinstance(value, str):
        try:
            location.check(value)
        except UsageError as exc:
            return str(exc)
    return f"{name}={value!r} is not a directory or a bucket URL"


_CKPT_LOCATION = _Rule(_checkpoint_location, _location_holds, _location_message, "DIR")


_NUMERIC_GUARD = _Rule(
    str, lambda v: v in NUMERIC_GUARD_CHOICES,
    lambda n, v: f"{n}={v!r} is not one of {', '.join(NUMERIC_GUARD_CHOICES)}", choices=NUMERIC_GUARD_CHOICES,
)
_LOSS_SPIKE = _Rule(
    non_negative_float, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf,
    lambda n, v: f"{n} must be 0 or more (and finite), not {v}", "F",
)
_DEVICE = _Rule(
    str, lambda v: v in DEVICE_CHOICES, lambda n, v: f"{n}={v!r} is not one of {', '.join(DEVICE_CHOICES)}",
    choices=DEVICE_CHOICES,
)
_PORT = _Rule(
    port_number, lambda v: isinstance(v, int) and 0 <= v <= 65535, lambda n, v: f"{n}={v} is not a port number",
    "N",
)
_ADDRESS = _Rule(str, lambda v: isinstance(v, str) and bool(v), lambda n, v: f"{n}={v!r} is no address", "ADDR")
_SLOW_RANKS = _Rule(
    str, lambda v: v in SLOW_RANKS_CHOICES,
    lambda n, v: f"{n}={v!r} is not one of {', '.join(SLOW_RANKS_CHOICES)}", choices=SLOW_RANKS_CHOICES,
)
_FACTOR_ABOVE_1 = _Rule(
    _factor_above_1, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 1 < v < math.inf,
    lambda n, v: f"{n} must be above 1 (and finite), not {v}", "F",
)


SECTIONS = ("run", "checkpoint", "integrity", "observe", "timeouts", "slow ranks")


def setting(default: Any, rule: _Rule, section: str) -> Any:
    """A field of `RunConfig`: its default, the rule its values follow (as a flag and as a keyword), and the
    section of the settings it belongs to."""
    assert section in SECTIONS, section
    return field(default=default, metadata={"rule": rule, "section": section})


@dataclass(kw_only=True)
class RunConfig:
    """How the runtime behaves. Every field is also a flag (see the module docstring)."""

    seed: int = setting(0, _at_least(0), "run")
    """Seeds initial weights (the same on every rank), each rank's random stream and the data order."""
    ckpt_dir: str | None = setting(None, _CKPT_LOCATION, "checkpoint")
    """Commit checkpoints here and resume from the newest good one: a directory, or s3://BUCKET/PREFIX
    (docs/object-storage.md; unset: no checkpoints)."""
    ckpt_every: int | str = setting(50, _CKPT_EVERY, "checkpoint")
    """Steps between checkpoints (0: only the final one and on SIGTERM), or epochs: 2e commits one at the end
    of every second epoch."""
    ckpt_keep: int = setting(3, _at_least(2, "K"), "checkpoint")
    """Committed checkpoints to keep; at least 2, so a torn newest one has a fallback."""
    ckpt_max_failures: int = setting(3, _at_least(1), "checkpoint")
    """Checkpoints that may fail in a row (full disk, I/O errors) before the job stops with exit 75."""
    ckpt_timeout: float = setting(600.0, _SECONDS_ABOVE_0, "checkpoint")
    """Seconds the final or a preemption checkpoint may take to commit before the job stops with exit 75."""
    ckpt_restore_timeout: float = setting(600.0, _SECONDS_ABOVE_0, "checkpoint")
    """Seconds reading a checkpoint may take on restore before the job stops with exit 75 (not a restart loop)."""
    snapshot_every: int | str = setting("auto", _SNAPSHOT_EVERY, "checkpoint")
    """Steps between in-memory snapshots under torchrevive-run, which a failure resumes from (0: off; auto: as
    often as 1 % of the loop's time buys, measured: every step at the GPT recipe's default size; at most
    Young/Daly's interval for --mtbf-hours and --ckpt-every)."""
    mtbf_hours: float = setting(50_000.0, _SECONDS_ABOVE_0_HOURS, "checkpoint")
    """Assumed mean hours between failures of one worker, for --snapshot-every auto (Llama 3: one
    unexpected interruption per ~50,000 GPU-hours)."""
    replica_check_every: int | str = setting("auto", _REPLICA_CHECK_EVERY, "integrity")
    """Steps between replica checks: the ranks compare parameter digests, and a mismatch is rolled back to the
    last passing check, replayed and named (0: off; auto: the fewest steps that keep the checks under 0.5 %
    of the loop's time, measured)."""
    numeric_guard: str = setting("off", _NUMERIC_GUARD, "integrity")
    """What a non-finite loss or gradient norm (or a --loss-spike) does, caught before the optimizer step:
    off, stop (one line, exit 81), skip the batch, or rollback to the last passing replica check and skip it."""
    loss_spike: float = setting(0.0, _LOSS_SPIKE, "integrity")
    """Under --numeric-guard: a loss above this many times the median of the last 50 is bad too (0: off)."""
    events: str | None = setting(None, _PATH, "observe")
    """Append the JSON-lines event log here (rank 0)."""
    device: str = setting("auto", _DEVICE, "run")
    """auto, cpu or cuda: cuda:LOCAL_RANK when the process sees a GPU per local worker, cuda:0 when it
    sees exactly one (a GPU per task); auto takes cpu when no GPU is visible."""
    metrics_port: int = setting(0, _PORT, "observe")
    """Serve Prometheus /metrics on this port + LOCAL_RANK (0: off)."""
    metrics_host: str = setting(DEFAULT_METRICS_HOST, _ADDRESS, "observe")
    """Where the metrics endpoint binds (loopback unless told: it has no authentication; 0.0.0.0 in a pod)."""
    collective_timeout: float = setting(300.0, _SECONDS_ABOVE_0, "timeouts")
    """Seconds before a collective with a dead peer fails instead of hanging."""
    term_grace: float = setting(15.0, _SECONDS_ABOVE_0, "timeouts")
    """After SIGTERM, seconds to reach the step where every rank has learned of it (the next vote but one, within
    a quarter of this) and checkpoint; a worker blocked past it exits at once."""
    hang_timeout: float = setting(300.0, _SECONDS_0_OR_MORE, "timeouts")
    """Exit (status 124) when no step completes for this long, so torchrun restarts the group (0: off)."""
    heal_wait: float = setting(30.0, _SECONDS_ABOVE_0, "timeouts")
    """With torchrevive-run --survivors keep or train-on: seconds survivors wait for a failed worker's agent to start its replacement
    (plus the time a stopped worker is given); past it the node is taken for lost and a new round of the
    nodes left goes on (exit 76)."""
    log_every: int = setting(10, _at_least(1), "observe")
    """Steps between progress lines when stdout is not a terminal."""
    slow_ranks: str = setting("report", _SLOW_RANKS, "slow ranks")
    """What a rank whose own work per sample stays --slow-factor times the others' median does: off (not
    measured), report (named: a line, a `straggler` event, a metric; the math unchanged), rebalance (also
    each rank's share of the global batch follows its speed, its gradient weighted by its share: the same
    update, every sample once, but other samples per rank than an even split), evict (rebalance, and a rank
    still --evict-factor times slower, or too slow for its smallest share, leaves the job with its node under
    torchrevive-run --survivors train-on; without train-on it is reported and rebalanced)."""
    slow_factor: float = setting(1.5, _FACTOR_ABOVE_1, "slow ranks")
    """A rank is a straggler when the median of its work per sample over the others' median, over the last
    --slow-window votes (about one a second), is at least this (a busy shared machine wanders to 1.3x)."""
    slow_window: int = setting(5, _at_least(1), "slow ranks")
    """Votes (about one a second) a rank's slowdown is judged over: its median over them decides."""
    evict_factor: float = setting(3.0, _FACTOR_ABOVE_1, "slow ranks")
    """With --slow-ranks evict: a rank whose median slowdown over the --slow-window votes is at least this
    (above --slow-factor) is evicted."""

    def __post_init__(self) -> None:
        for name in ("ckpt_dir", "events"):  # a pathlib.Path is a path too
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if isinstance(self.ckpt_every, str):  # "2epochs", "50": the flag's forms (a bad one fails its rule below)
            self.ckpt_every = read_value(steps_or_epochs, self.ckpt_every, problem=None)
        for name, rule in _rules().items():
            value = getattr(self, name)
            if not rule.holds(value):
                raise UsageError(rule.message(name, value))
        if self.slow_ranks == "evict" and self.evict_factor <= self.slow_factor:
            raise UsageError(f"--evict-factor ({self.evict_factor:g}) must be above --slow-factor "
                             f"({self.slow_factor:g}): a rank is evicted only once it is a straggler")

    @property
    def ckpt_wait_slice(self) -> float:
        """Seconds a wait for storage lasts before a short collective: far below the collective and hang timeouts."""
        return min(5.0, self.collective_timeout / 4, (self.hang_timeout or math.inf) / 4)

    @property
    def ckpt_every_steps(self) -> int:
        """Steps between checkpoints; 0 when none are by steps (`--ckpt-every` in epochs, or 0)."""
        return self.ckpt_every if isinstance(self.ckpt_every, int) else 0

    @property
    def ckpt_every_epochs(self) -> int:
        """Epochs between checkpoints, each at the end of an epoch; 0 when they are by steps."""
        return int(self.ckpt_every[:-1]) if isinstance(self.ckpt_every, str) else 0

    @classmethod
    def from_args(cls, args: Any) -> RunConfig:
        """The runtime's settings among `args`: argparse's namespace (--ckpt-dir is ckpt_dir), or a mapping (a
        dict, a config file's section, a hydra DictConfig) or a dataclass instance (elastic._shared.common.
        settings_input). The script's own names are left to it; None takes the default; text reads as the flag
        would read it ("50", "auto", "2e"): a bad value is one `UsageError` line, as for a flag."""
        given, rules = as_settings(args), _rules()
        return cls(**{f.name: read_value(rules[f.name].parse, given[f.name], rules[f.name].message(f.name, given[f.name]))
                      for f in fields(cls) if given.get(f.name) is not None})

    @classmethod
    def of(cls, **settings: Any) -> RunConfig:
        """`RunConfig(**settings)` (`elastic.Run(**settings)`), a name that is no setting refused in one line."""
        unknown = sorted(set(settings) - {f.name for f in fields(cls)})
        if unknown:
            raise UsageError(f"no runtime setting named {', '.join(unknown)}; they are: {', '.join(f.name for f in fields(cls))}")
        return cls(**settings)


def _rules() -> dict[str, _Rule]:
    """Each setting's rule, read from its field (`setting`)."""
    return {spec.name: spec.metadata["rule"] for spec in fields(RunConfig)}


def sections() -> dict[str, list[str]]:
    """The settings by section (`--help` shows them so), in the fields' order."""
    grouped: dict[str, list[str]] = {}
    for spec in fields(RunConfig):
        grouped.setdefault(spec.metadata["section"], []).append(spec.name)
    return grouped


@cache
def field_help() -> dict[str, str]:
    """Each field's docstring, as one line (read from this module's source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(RunConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(following, ast.Expr):
            value = following.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs[node.target.id] = " ".join(value.value.split())
    return docs


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_runtime_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add every `RunConfig` field to `parser` as a flag; `defaults` are this script's own
    defaults for some of them (`ckpt_every=200`), checked by the same rules."""
    known = {f.name: f for f in fields(RunConfig)}
    unknown = sorted(set(defaults) - set(known))
    if unknown:
        raise TypeError(f"no runtime setting named {', '.join(unknown)}; they are {', '.join(known)}")
    rules, docs = _rules(), field_help()
    groups = {section: parser.add_argument_group(f"runtime: {section}") for section in sections()}
    for name, spec in known.items():
        default = defaults.get(name, spec.default if spec.default is not MISSING else None)
        rule = rules[name]
        if default is not None and not rule.holds(default):
            raise UsageError(f"the script's default {rule.message(name, default)}")
        groups[spec.metadata["section"]].add_argument(
            flag(name), type=rule.parse, default=default, choices=rule.choices, metavar=rule.metavar,
            help=docs.get(name, "").replace("%", "%%"),
        )


class ArgumentParser(OneLineArgumentParser):
    """An argument parser that already holds the runtime flags (`add_runtime_arguments`) and
    reports a bad value in one line with exit status 2; a script adds its own flags. Keyword
    arguments named after `RunConfig` fields are this script's defaults for those flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = {f.name for f in fields(RunConfig)}
        defaults = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        super().__init__(*args, **kwargs)
        add_runtime_arguments(self, **defaults)


def flag_table() -> str:
    """The markdown table of every runtime flag, its default and its meaning (docs/reference.md)."""
    rules, docs = _rules(), field_help()
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for spec in fields(RunConfig):
        rule = rules[spec.name]
        shape = "{" + ",".join(rule.choices) + "}" if rule.choices else rule.metavar
        default = "unset" if spec.default is None else spec.default
        rows.append(f"| `{flag(spec.name)} {shape}` | {default} | {docs.get(spec.name, '')} |")
    return "\n".join(rows) + "\n"
