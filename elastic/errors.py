"""The errors a user can cause, as one small hierarchy.

Every `ElasticError` carries a message that fits on one line and says what was
wrong and what to do. Entry points (`elastic.cli.run_main`) turn them into that
one line on stderr and a non-zero exit status; library code never prints them.
"""


class ElasticError(Exception):
    """Base of every error the runtime reports to a user."""

    exit_code = 1


class UsageError(ElasticError):
    """Bad command-line values or inputs (missing data, impossible sizes)."""

    exit_code = 2


class EnvironmentConfigError(ElasticError):
    """The launcher's environment (RANK, WORLD_SIZE, ...) is malformed."""

    exit_code = 2


class CheckpointError(ElasticError):
    """No checkpoint can be loaded: all are corrupt, or the directory is unusable."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that verifies but belongs to another model, optimizer or data set."""

    exit_code = 2


class Preempted(ElasticError):
    """SIGTERM arrived; a checkpoint at the current step was committed before exiting.

    The exit status is 128 + SIGTERM, as a shell reports a process ended by that
    signal, so torchrun and schedulers treat the worker as stopped, not finished.
    """

    exit_code = 143
