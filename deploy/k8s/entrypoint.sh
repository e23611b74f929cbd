#!/bin/sh
# The image's entrypoint: run the container's arguments (the torchrun line).
#
# A StatefulSet restarts a container that exits, even with status 0, so a pod
# whose job finished would start training again. With IDLE_AFTER_SUCCESS=1 (the
# trainer manifest sets it) a successful run leaves the pod idle instead; the
# job's state is in its checkpoints and event log, and `kubectl delete -k`
# releases the pods. Failures exit with their status, so Kubernetes restarts
# the pod and the job resumes from its newest checkpoint.
"$@"
status=$?
if [ "$status" -eq 0 ] && [ "${IDLE_AFTER_SUCCESS:-0}" = "1" ]; then
    echo "entrypoint: the job finished; idling so the StatefulSet does not start it again" >&2
    trap 'exit 0' TERM INT
    while :; do sleep 3600 & wait $!; done
fi
exit "$status"
