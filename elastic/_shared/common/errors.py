"""The errors a user can cause, as one small hierarchy.

Every `ElasticError` carries a message that fits on one line and says what was
wrong and what to do. Entry points (`elastic._shared.common.cli.run_main`) turn them into that
one line on stderr and a non-zero exit status; library code never prints them.
"""



def first_line(exc: BaseException) -> str:
    """The first line of an error's message (torch's run to a page), or its type's name when empty."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

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


class CheckpointStorageError(CheckpointError):
    """The checkpoint storage refuses writes (full, over quota, read-only, failing):
    saves failed `--ckpt-max-failures` times in a row, or the final or preemption
    save failed, or a restart finds the storage still unusable. The committed
    checkpoints are intact; training on would only lose more work.

    Exit status 75 (EX_TEMPFAIL: fix the storage and run again). The launcher
    does not restart a group that exits with it.
    """

    exit_code = 75
    raised_everywhere = True
    """Raised on every rank at the same step, so the ranks leave together."""


class RestoreTimedOut(CheckpointStorageError):
    """Reading a checkpoint on restore passed --ckpt-restore-timeout (exit 75, not restarted).

    Not raised everywhere at once: a rank stuck inside a read never raises it,
    so leaving must not wait for peers."""

    raised_everywhere = False


class CheckpointMismatchError(CheckpointError):
    """A checkpoint that verifies but belongs to another model, optimizer or data set."""

    exit_code = 2


class Preempted(ElasticError):
    """SIGTERM arrived; a checkpoint at the current step was committed before exiting.

    The exit status is 128 + SIGTERM, as a shell reports a process ended by that
    signal, so torchrun and schedulers treat the worker as stopped, not finished.
    """

    exit_code = 143
    raised_everywhere = True


class PeerLost(ElasticError):
    """A collective of this worker broke because a peer worker died (killed, crashed, its node lost), and
    the job restarts every worker (`--survivors restart`, torch's way): this one stops too.

    Not this worker's fault: its agent counts it as the peer's failure, never as a primary one (the exit
    status says so: elastic._shared.protocol.exit_status.PEER_LOST_EXIT), and the line says which step broke.
    """

    exit_code = 83


class CorruptCheckpoint(Exception):
    """A committed checkpoint whose manifest or data do not verify (a torn or damaged write).

    Internal: restore falls back to the previous checkpoint and moves this one aside;
    it reaches a user only inside a `CheckpointError` line."""
