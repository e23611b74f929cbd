"""Pods as processes: the rendered manifests' own commands run an elastic job that survives a deleted pod.

The cpu overlay is rendered; etcd starts from its StatefulSet's command (etcd
from Debian's package standing in for the image's) on TLS, with certificates
made by deploy/k8s/make-etcd-certs.sh as the Secrets' folders, and two trainer "pods"
start from the trainer StatefulSet's entrypoint, args, env and ConfigMap,
with service names mapped to loopback and /ckpt to a shared folder. One pod is
deleted (its whole process tree SIGKILLed) and, as the StatefulSet controller
would, started again under the same name; the job must recover and complete.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kube import (
    K8S,
    KUSTOMIZATIONS,
    PodProcess,
    build,
    find,
    kubectl,
    local_executables,
    render,
)
from support import free_port, wait_for

from elastic._agent.launcher.proctree import descendants
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

STEPS = 60
HOLD_AT = 10


def faults(tmp_path: Path) -> dict[str, str]:
    """ELASTIC_FAULT for the pods: rank 0 of a group of both pods holds after step 10 or later until the
    test has deleted a pod (so the deletion lands mid-run however fast the job trains, in a group of both
    even when a loaded machine started the second pod after the first round closed; once in the whole
    job); and while one pod trains alone its steps are paced to 0.3 s, so a pod that starts late or is
    recreated still finds the job running when it is ready to join (at world size 2 it runs at full speed)."""
    return {
        "ELASTIC_FAULT": f"after_step@{HOLD_AT}+:do=hold:until={tmp_path / 'go'}:restart=any:once:world=2,"
                         "after_step@1+:do=slow:for=0.3:restart=any:world=1",
        "ELASTIC_FAULT_ONCE_DIR": str(tmp_path / "fault-marks"),
    }
# What a user would set in trainer-config for a small CPU run.
SETTINGS = {"MAX_STEPS": str(STEPS), "CKPT_EVERY": "5", "BATCH_SIZE": "4", "JOB_ID": "k8s-test"}


def delete_pod(process: subprocess.Popen) -> None:
    """What deleting a pod does to its container, minus the grace period: SIGKILL to every process in it."""
    for pid in [process.pid, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(10)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian package etcd-server)")
def test_the_manifests_commands_train_recover_from_a_deleted_pod_and_complete(tmp_path: Path) -> None:
    objects = render(K8S / "overlays" / "cpu")
    ports = {2379: free_port(), 2380: free_port(), 2381: free_port()}
    network = {
        "hosts": {"etcd-client": "127.0.0.1", "etcd-0.etcd": "127.0.0.1"},
        "ports": ports,
        "executables": local_executables(),
    }
    pki = tmp_path / "pki"  # the Secrets' contents, made as docs/kubernetes.md says
    subprocess.run(["sh", str(K8S / "make-etcd-certs.sh"), str(pki)], check=True, capture_output=True, timeout=120)
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "secret").write_bytes(os.urandom(32))
    etcd = PodProcess(objects, find(objects, "StatefulSet", "etcd"), "etcd-0",
                      mounts={"/var/lib/etcd": tmp_path / "etcd", "/etc/etcd/tls": pki / "etcd-server"}, **network)
    (tmp_path / "etcd").mkdir()
    pods: dict[str, subprocess.Popen] = {}
    events = tmp_path / "ckpt" / f"{SETTINGS['JOB_ID']}-events.jsonl"
    (tmp_path / "ckpt").mkdir()

    def trainer(name: str) -> PodProcess:
        # Two pods on one machine share its address: each gets its own metrics port.
        settings = {**SETTINGS, "METRICS_PORT": str(metrics_ports[name])}
        (tmp_path / f"{name}-tmp").mkdir(exist_ok=True)  # the pod's /tmp: a new pod, the same emptyDir
        mounts = {"/ckpt": tmp_path / "ckpt", "/etc/torchrevive/etcd-tls": pki / "etcd-client",
                  "/etc/torchrevive/snapshot": tmp_path / "snapshot", "/tmp": tmp_path / f"{name}-tmp"}
        return PodProcess(objects, find(objects, "StatefulSet", "trainer"), name, mounts=mounts,
                          config_overrides={"trainer-config": settings}, **network)

    (tmp_path / "fault-marks").mkdir()

    def start(name: str) -> None:
        pods[name] = trainer(name).start(tmp_path / f"{name}.log", {"OMP_NUM_THREADS": "1", **faults(tmp_path)})

    def logs() -> str:
        return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text(errors='replace')[-2500:]}" for n in pods)

    def records() -> list[dict]:
        return list(read_events(events)) if events.exists() else []

    metrics_ports = {"trainer-0": free_port(), "trainer-1": free_port()}
    etcd_process = etcd.start(tmp_path / "etcd.log", {})
    try:
        probe = etcd.container["readinessProbe"]["httpGet"]
        probe_port = ports[{p["name"]: p["containerPort"] for p in etcd.container["ports"]}[probe["port"]]]
        wait_for(lambda: http_ok(f"http://127.0.0.1:{probe_port}{probe['path']}"), 30, "etcd's readiness probe")
        for name in ("trainer-0", "trainer-1"):
            start(name)
        wait_for(lambda: (tmp_path / "go.held").exists(), 180, f"both pods training to step {HOLD_AT}")
        # (a scrape may take more than its 2 s on a loaded machine: one miss is not an endpoint that is down)
        wait_for(lambda: all(http_ok(f"http://127.0.0.1:{port}/metrics") for port in metrics_ports.values()), 30,
                 "the pods' metrics endpoints to answer")

        delete_pod(pods["trainer-1"])
        deleted_at = time.time()
        (tmp_path / "go").touch()  # rank 0 goes on (if it was not in the deleted pod) into the broken group
        start("trainer-1")  # the StatefulSet controller recreates the pod under its name

        def finished(name: str) -> bool:
            return "the job finished; idling" in (tmp_path / f"{name}.log").read_text(errors="replace")

        wait_for(lambda: all(finished(n) for n in pods), 240, f"both pods to finish the job\n{logs()}")
        assert all(p.poll() is None for p in pods.values()), "a finished pod idles rather than exit (StatefulSet)"
        for process in pods.values():
            process.terminate()  # pod deleted after the job: the idle entrypoint exits 0 on SIGTERM
        assert [p.wait(20) for p in pods.values()] == [0, 0]
    finally:
        for process in [*pods.values(), etcd_process]:
            if process.poll() is None:
                delete_pod(process)

    history = records()
    steps = [r for r in history if r["event"] == "step"]
    starts = [r for r in history if r["event"] == "start"]
    # Both pods trained together when one was deleted: the group that held had both (its start event, written at
    # once; the step lines before the hold may be lost with the worker that buffered them). On a loaded machine the
    # first round may close before the second pod's agent came: that pod then joined a later one.
    before = [r for r in starts if r["time"] < deleted_at]
    assert before and before[-1]["world_size"] == 2, starts
    assert any(r["time"] > deleted_at for r in starts), "no new worker group after the deletion"
    assert starts[-1]["world_size"] == 2 and steps[-1]["world_size"] == 2, "the recreated pod did not rejoin"
    (end,) = [r for r in history if r["event"] == "end"]
    assert end["step"] == STEPS and steps[-1]["step"] == STEPS, logs()
    assert len(set(end["param_digests"])) == 1, "the replicas ended different"
    final = tmp_path / "ckpt" / SETTINGS["JOB_ID"] / f"step_{STEPS:08d}"
    assert json.loads((final / "manifest.json").read_text())["step"] == STEPS, "the final checkpoint is on the shared volume"


@pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed: nothing to compare the fallback with")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)) or "base")
def test_the_fallback_renders_what_kubectl_renders(directory: Path) -> None:
    def keyed(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
        return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objects}

    assert keyed(build(directory)) == keyed(render(directory, use_kubectl=True))
