# Sourced by the batch scripts of deploy/slurm (not run on its own). It sets up what every
# variant shares, then `run_step` starts the job step and waits for it:
#
# - CKPT_DIR: the job's checkpoints and event log; per job id, so a requeued run (same id)
#   resumes from its own checkpoints and a new submission starts afresh. Give CKPT_DIR to
#   continue an earlier job's run.
# - A secret for the snapshot keepers' traffic between nodes (docs/security.md), made once per
#   CKPT_DIR with mode 600 on the shared file system: never on a command line or in the log.
# - The requeue signal: `#SBATCH --signal=B:USR1@90` sends USR1 to this batch shell only;
#   the trap passes it to every process of the job's steps (`scancel --signal` without --batch
#   signals the steps, not this shell). With `--signal=USR1@90` (no B:) Slurm signals the
#   steps itself and the trap never fires.
# The scripts give srun `--kill-on-bad-exit=0` under torchrevive-run (a task that dies, a lost
# node, does not end the step: the other nodes' agents go on within --nnodes MIN:MAX), and
# `--kill-on-bad-exit=1` with a task per worker (a lost worker leaves no group to go on with).

REPO=${TORCHREVIVE_REPO:-${SLURM_SUBMIT_DIR:?run this through sbatch}}
cd "$REPO" || exit 2
VENV=${TORCHREVIVE_VENV:-$REPO/.venv}
export PATH="$VENV/bin:$PATH"
CKPT_DIR=${CKPT_DIR:-$REPO/runs/gpt-$SLURM_JOB_ID}
mkdir -p "$CKPT_DIR"
if [ ! -s "$CKPT_DIR/.snapshot-secret" ]; then
  (umask 077 && head -c 32 /dev/urandom > "$CKPT_DIR/.snapshot-secret")
fi
export TORCHREVIVE_SNAPSHOT_SECRET_FILE="$CKPT_DIR/.snapshot-secret"
export TORCHREVIVE_REQUEUE_SIGNAL=${TORCHREVIVE_REQUEUE_SIGNAL:-USR1}
echo "torchrevive: job $SLURM_JOB_ID run ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, checkpoints in $CKPT_DIR"

run_step() {  # run_step SRUN_ARGS... COMMAND...: srun it in the background and wait, passing the signal on
  trap 'scancel --signal="$TORCHREVIVE_REQUEUE_SIGNAL" "$SLURM_JOB_ID"' "$TORCHREVIVE_REQUEUE_SIGNAL"
  srun "$@" &
  local step=$! status=0
  while true; do
    wait "$step" && status=0 || status=$?
    kill -0 "$step" 2>/dev/null || break  # wait returned for the trap, not for srun: wait again
  done
  return "$status"
}
