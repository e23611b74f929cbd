"""Command-line edge shared by recipes and tools.

Invariants:
- A bad flag or value prints exactly one line on stderr (`<prog>: error: ...`)
  and exits with status 2, as DESIGN.md's recipe contract requires; argparse's
  default prints the whole usage block first.
- `run_main` turns any `ElasticError` into its one line and its exit code, so
  library code raises typed errors and never calls `sys.exit` itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Callable

from elastic._shared.common import threads
from elastic._shared.common.errors import ElasticError


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but errors are one line and exit 2 (`--help` still prints usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


_EPOCHS = re.compile(r"([0-9]+)\s*(?:e|epochs?)")


def steps_or_epochs(text: str) -> int | str:
    """An argparse type: a number of steps, 0 or more ("50" is 50), or of epochs, 1 or more ("2e", "1epoch",
    "3 epochs": normalised to "2e")."""
    epochs = _EPOCHS.fullmatch(text.strip())
    if epochs is not None and int(epochs[1]) >= 1:
        return f"{int(epochs[1])}e"
    try:
        return int_at_least(0)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps (0 or more) or of epochs (2e)") from None


def is_steps_or_epochs(value: object) -> bool:
    """Whether `value` is what `steps_or_epochs` returns: an int >= 0, or "Ne" with N >= 1."""
    if isinstance(value, str):
        return re.fullmatch(r"[1-9][0-9]*e", value) is not None
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a positive finite number")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number >= 0")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0 meaning off."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535, 0: off)")
    return value


def unit_interval(text: str) -> float:
    """A float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1)")
    return value


def configure_logging(rank: int | None = None) -> None:
    """Plain log lines with the rank; level from LOGLEVEL (default INFO)."""
    rank_part = "" if rank is None else f"[rank{rank}] "
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s {rank_part}%(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run an entry point; an `ElasticError` becomes one stderr line and its exit code."""
    prog = os.path.basename(sys.argv[0]) or "elastic"
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name:  # started with -m: name it as the user typed it
        prog = f"python -m {spec.parent if prog == '__main__.py' else spec.name}"
    try:
        status = main(argv) or 0
    except ElasticError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        status = exc.exit_code
    threads.note_exit_status(status)  # the status to end with should a library thread outlive the exit's bound
    return status
