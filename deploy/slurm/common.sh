# Sourced by the batch scripts of deploy/slurm (not run on its own). It sets up what every
# variant shares, then `run_step` starts the job step and waits for it:
#
# - The requeue signal (TORCHREVIVE_REQUEUE_SIGNAL, USR1 by default; it must be the one the
#   script's `#SBATCH --signal` names): `--signal=B:USR1@90` sends it to this batch shell only,
#   and the trap passes it to every process of the job's steps (`scancel --signal` without
#   --batch signals the steps, not this shell). With `--signal=USR1@90` (no B:) Slurm signals
#   the steps itself and the trap never fires. USR1 and USR2 are ignored from the first line
#   on, so a warning signal never ends this shell (and with it the job) before the trap is set.
# - CKPT_DIR: the job's checkpoints and event log; per job id, so a requeued run (same id)
#   resumes from its own checkpoints and a new submission starts afresh. Give CKPT_DIR to
#   continue an earlier job's run.
# - The job's secret, which signs every value its agents and workers read from the rendezvous and
#   worker stores and the snapshot keepers' traffic between nodes (docs/security.md), made once per
#   CKPT_DIR with mode 600 on the shared file system; one that exists must be yours, mode 600,
#   and not empty. Never on a command line or in the log.
# - TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long an agent that stops its workers waits for their
#   preemption commit before SIGKILL (torch's default, 30 s, is shorter than the warning the
#   scripts ask Slurm for).
#
# The scripts give srun `--kill-on-bad-exit=0` under torchrevive-run (a task that dies, a lost
# node other than the first, does not end the step: the other agents go on within --nnodes
# MIN:MAX), and `--kill-on-bad-exit=1` with a task per worker (a lost worker leaves no group to
# go on with).

trap '' USR1 USR2
REQUEUE_SIGNAL=${TORCHREVIVE_REQUEUE_SIGNAL:-USR1}
REQUEUE_SIGNAL=${REQUEUE_SIGNAL#SIG}
REQUEUE_SIGNAL=${REQUEUE_SIGNAL^^}
case "$REQUEUE_SIGNAL" in
  USR1|USR2) trap 'scancel --signal="$REQUEUE_SIGNAL" "$SLURM_JOB_ID"' "$REQUEUE_SIGNAL" ;;
  NONE) ;;
  *) echo "torchrevive: TORCHREVIVE_REQUEUE_SIGNAL=$TORCHREVIVE_REQUEUE_SIGNAL is not USR1, USR2 or none" >&2
     exit 2 ;;
esac
export TORCHREVIVE_REQUEUE_SIGNAL=$REQUEUE_SIGNAL

REPO=${TORCHREVIVE_REPO:-${SLURM_SUBMIT_DIR:?run this through sbatch}}
cd "$REPO" || exit 2
VENV=${TORCHREVIVE_VENV:-$REPO/.venv}
export PATH="$VENV/bin:$PATH"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-75}
CKPT_DIR=${CKPT_DIR:-$REPO/runs/gpt-$SLURM_JOB_ID}
mkdir -p "$CKPT_DIR" || exit 2

secret="$CKPT_DIR/.snapshot-secret"
if [ ! -e "$secret" ]; then  # made aside (mktemp: mode 600) and moved in without overwriting
  made=$(mktemp "$CKPT_DIR/.snapshot-secret.XXXXXX") &&
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$made" && mv -n "$made" "$secret"  # 32 bytes as hex
  rm -f "$made"
fi
if [ ! -O "$secret" ] || [ ! -s "$secret" ] || [ "$(stat -c %a "$secret")" != 600 ]; then
  echo "torchrevive: $secret must be a non-empty file of yours with mode 600 (it signs the job)" >&2
  exit 2
fi
export TORCHREVIVE_SNAPSHOT_SECRET_FILE="$secret"
echo "torchrevive: job $SLURM_JOB_ID run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, checkpoints in $CKPT_DIR"

# Final statuses: a restart or a requeue would meet the same stop (2: bad input, 75: checkpoint storage
# refuses writes, 78: a crash loop, the same failure after the same step attempt after attempt). The
# job is then made not requeueable (scontrol update Requeue=0), so neither a pending requeue signal nor
# Slurm's own requeue (a node failure under --requeue) starts it again.
FINAL_EXIT_CODES=${FINAL_EXIT_CODES:-"2 75 78"}

run_step() {  # run_step SRUN_ARGS... COMMAND...: srun it in the background and wait, passing the signal on
  srun "$@" &
  local step=$!
  while kill -0 "$step" 2>/dev/null; do
    wait "$step"  # returns early when the trap runs: then wait again
  done
  wait "$step"  # srun's own exit status
  local status=$?
  local final
  for final in $FINAL_EXIT_CODES; do
    if [ "$status" = "$final" ]; then
      echo "torchrevive: the job stopped with final exit status $status (2: bad input, 75: storage, 78: a crash loop); not requeued: fix the cause and submit again" >&2
      scontrol update JobId="$SLURM_JOB_ID" Requeue=0 >/dev/null 2>&1 ||
        echo "torchrevive: scontrol could not turn off the requeue of job $SLURM_JOB_ID" >&2
    fi
  done
  return "$status"
}
