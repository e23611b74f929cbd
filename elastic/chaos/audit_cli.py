"""`python -m elastic.chaos audit PREFIX`: the exactly-once audit of a job's sample records, as a command.

    ELASTIC_SAMPLE_LOG=runs/samples torchrevive-run ... -m elastic.chaos.samples recipes/gpt.py ...
    python -m elastic.chaos audit runs/samples

reads the records every rank appended to `PREFIX.rank<R>` (elastic.chaos.samples) and prints the audit's
verdict: one line when every sample of the history that survived was trained exactly once and every step
trained again after a restore started from the random streams it first started from (exit 0), else that
line and one line per problem found (exit 1). No records under the prefix is one line and exit 2.
It needs nothing beyond the package (no torch job, no matplotlib).
"""

from __future__ import annotations

from pathlib import Path

from elastic._shared.common.cli import OneLineArgumentParser
from elastic._shared.common.errors import ElasticError, UsageError
from elastic.chaos.samples import LOG_ENV, audit

MAX_PROBLEM_LINES = 20


def build_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m elastic.chaos audit",
                              description="Check that a job trained on every sample exactly once.")
    p.add_argument("prefix", help=f"the {LOG_ENV} the job ran with (its records are PREFIX.rank0, PREFIX.rank1, ...)")
    return p


def main(argv: list[str]) -> int:
    prefix = Path(build_parser().parse_args(argv).prefix)
    if not prefix.parent.is_dir() or not any(prefix.parent.glob(prefix.name + ".rank*")):
        raise UsageError(f"no sample records at {prefix}.rank*: run the job with {LOG_ENV}={prefix} "
                         "and `-m elastic.chaos.samples SCRIPT` (docs/chaos.md)")
    result = audit(prefix)
    print(result.summary())
    if result.ok and not result.drift:
        return 0
    found = [*result.problems, *result.drift]
    for problem in found[:MAX_PROBLEM_LINES]:
        print(f"  {problem}")
    if len(found) > MAX_PROBLEM_LINES:
        print(f"  ... and {len(found) - MAX_PROBLEM_LINES} more")
    raise ElasticError(f"the audit of {prefix} found {len(found)} problem(s)")
