#!/bin/sh
# The image's entrypoint: run the container's arguments (the torchrun line).
#
# In a pod this shell is PID 1, and PID 1 ignores SIGTERM unless it handles
# it: so it passes SIGTERM and SIGINT on to the job (kubectl delete pod, a
# scale-down or a node drain then reaches torchrun, whose workers finish their
# step and commit a checkpoint), and exits with the job's status.
#
# A StatefulSet restarts a container that exits, even with status 0, so a pod
# whose job finished would start training again. With IDLE_AFTER_SUCCESS=1 (the
# trainer manifest sets it) a successful run leaves the pod idle instead; the
# job's state is in its checkpoints and event log, and `kubectl delete -k`
# releases the pods. Failures exit with their status, so Kubernetes restarts
# the pod and the job resumes from its newest checkpoint.
#
# Except the final ones: a status listed in FINAL_EXIT_CODES (the trainer
# manifest sets "2 75 78": bad input, checkpoint storage refuses writes, a
# crash loop: the same failure after the same step attempt after attempt) is one
# that every restart would meet again at the same check. The pod then says so
# in one line, writes that line to STOPPED_MARK (its readiness probe turns the
# pod not ready when the file exists) and idles until it is deleted or
# restarted: `kubectl rollout restart statefulset/trainer` once it is fixed.
if [ -n "${STOPPED_MARK:-}" ]; then
    rm -f "$STOPPED_MARK"  # a mark from before this container's restart is stale
fi
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT
# `wait` returns early (status > 128) when a trapped signal arrives: wait again
# until the job itself has exited, and keep its status.
while :; do
    wait "$child"
    status=$?
    kill -0 "$child" 2>/dev/null || break
done
trap - TERM INT
idle() {
    trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM INT  # the sleep must not outlive the shell
    while :; do sleep 3600 & sleeper=$!; wait "$sleeper"; done
}
if [ "$status" -eq 0 ] && [ "${IDLE_AFTER_SUCCESS:-0}" = "1" ]; then
    echo "entrypoint: the job finished; idling so the StatefulSet does not start it again" >&2
    idle
fi
for final in ${FINAL_EXIT_CODES:-}; do
    if [ "$status" = "$final" ]; then
        case $status in
            2) why="bad input (its first error line above says which)" ;;
            75) why="checkpoint storage refuses writes" ;;
            78) why="a crash loop: the same failure after the same step, attempt after attempt (the line above names the step, the rank and the error)" ;;
            *) why="listed in FINAL_EXIT_CODES" ;;
        esac
        line="entrypoint: the job stopped with exit status $status, $why; a restart would stop the same way, so this pod idles, not ready: fix the cause, then kubectl rollout restart statefulset/trainer"
        echo "$line" >&2
        if [ -n "${STOPPED_MARK:-}" ]; then
            # Written aside, then renamed: the mark appears whole or not at all, so whoever reads it
            # as soon as it exists (the probe, kubectl exec cat) never reads it empty.
            { echo "$line" > "$STOPPED_MARK.partial" && mv -f "$STOPPED_MARK.partial" "$STOPPED_MARK"; } ||
                echo "entrypoint: cannot write $STOPPED_MARK; the pod stays ready" >&2
        fi
        idle
    fi
done
exit "$status"
