"""A fault of the world inside a Hugging Face script: one stderr line and the runtime's exit status.

A `Trainer` script has no entry point of ours around it (recipes use
`elastic._shared.common.cli.run_main`), so the integration ends the process itself: a
refusal exits 2, a SIGTERM 143 once every rank committed, a failing storage
75. The same statuses torchrevive-run and torchrun read from every recipe.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from elastic._shared.common import threads
from elastic._shared.common.errors import ElasticError


@contextmanager
def exit_on_elastic_error(prog: str | None = None) -> Iterator[None]:
    """Turn an `ElasticError` raised inside into one line on stderr and `SystemExit(exit_code)`."""
    try:
        yield
    except ElasticError as exc:
        name = prog or os.path.basename(sys.argv[0]) or "elastic.hf"
        sys.stderr.write(f"{name}: error: {exc}\n")
        sys.stderr.flush()
        threads.note_exit_status(exc.exit_code)  # should a library thread outlive the exit's bound
        raise SystemExit(exc.exit_code) from None
