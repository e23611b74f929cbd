"""deploy/k8s renders, every object validates strictly, and the objects agree with each other.

Rendered by kube.build, the kustomize subset in this process; tests/integration/test_k8s_pods.py
checks it renders what `kubectl kustomize` does, where kubectl is installed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kube import (
    DOCKERFILE,
    K8S,
    KUSTOMIZATIONS,
    KustomizeError,
    PodProcess,
    build,
    dockerfile_instructions,
    find,
    image_entrypoint,
    pod_spec,
)
from support import REPO
from torch.distributed.run import get_args_parser

KUBERNETES_VERSION = "1.30"
# Kinds without a schema in kubernetes-validate, allowed only from this list,
# each with the fields it must carry.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints")}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)) or "base")
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return build(request.param)


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if pod_spec(o) is not None]


def test_every_object_validates_strictly_against_the_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    for obj in rendered:
        key = (obj["apiVersion"], obj["kind"])
        if key in CUSTOM_KINDS:
            assert all(f in obj["spec"] for f in CUSTOM_KINDS[key]), obj["metadata"]["name"]
            continue
        # Raises on an unknown field (strict), a wrong type, a missing required field,
        # and on a kind it has no schema for (so a new custom kind must be listed above).
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_misspelt_field_is_caught() -> None:
    objects = build(K8S)
    trainer = find(objects, "StatefulSet", "trainer")
    pod_spec(trainer)["containers"][0]["comand"] = ["oops"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(trainer, KUBERNETES_VERSION, strict=True)




def test_the_fallback_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {team: a}\n")
    with pytest.raises(KustomizeError, match="commonLabels"):
        build(tmp_path)


def test_everything_lives_in_one_namespace(rendered: list[dict[str, Any]]) -> None:
    (namespace,) = [o["metadata"]["name"] for o in rendered if o["kind"] == "Namespace"]
    assert {o["metadata"].get("namespace") for o in rendered if o["kind"] != "Namespace"} == {namespace}


def test_selectors_match_their_pods_and_services_find_them(rendered: list[dict[str, Any]]) -> None:
    pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in workloads(rendered)}
    for obj in workloads(rendered):
        selector = obj["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pods[obj["metadata"]["name"]].items(), f"{obj['metadata']['name']}: selector misses its pods"
    for service in (o for o in rendered if o["kind"] == "Service"):
        chosen = [name for name, labels in pods.items() if service["spec"]["selector"].items() <= labels.items()]
        assert len(chosen) == 1, f"Service {service['metadata']['name']} selects {chosen}"
    for budget in (o for o in rendered if o["kind"] == "PodDisruptionBudget"):
        assert any(budget["spec"]["selector"]["matchLabels"].items() <= labels.items() for labels in pods.values())
    for monitor in (o for o in rendered if o["kind"] == "ServiceMonitor"):
        services = [s for s in rendered if s["kind"] == "Service"
                    and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert services, "the ServiceMonitor selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)


def test_stateful_sets_name_a_headless_service_and_ports_exist(rendered: list[dict[str, Any]]) -> None:
    for sts in (o for o in rendered if o["kind"] == "StatefulSet"):
        service = find(rendered, "Service", sts["spec"]["serviceName"])
        assert service["spec"].get("clusterIP") == "None", f"{service['metadata']['name']} is not headless"
    for service in (o for o in rendered if o["kind"] == "Service"):
        (workload,) = [w for w in workloads(rendered)
                       if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        named = {p["name"]: p["containerPort"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in named or target in named.values(), f"{service['metadata']['name']}: no port {target}"
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        volumes = {v["name"] for v in spec.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        claims = {v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
        assert claims <= {o["metadata"]["name"] for o in rendered if o["kind"] == "PersistentVolumeClaim"}
        for container in spec["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in container and "httpGet" in container[probe]:
                    port = container[probe]["httpGet"]["port"]
                    assert port in {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
            for source in container.get("envFrom", []):
                find(rendered, "ConfigMap", source["configMapRef"]["name"])


def trainer(objects: list[dict[str, Any]]) -> PodProcess:
    return PodProcess(objects, find(objects, "StatefulSet", "trainer"), "trainer-0", mounts={}, use_entrypoint=False)


def test_the_trainer_runs_torchrun_with_arguments_torchrun_accepts(rendered: list[dict[str, Any]]) -> None:
    pod = trainer(rendered)
    argv = pod.argv()
    assert argv[0] == "torchrevive-run", "the container runs our torchrun (it takes every torchrun flag)"
    args = get_args_parser().parse_args(argv[1:])  # torchrun's own parser
    assert not [a for a in argv if "$(" in a], f"unexpanded variables: {argv}"
    minimum, maximum = (int(n) for n in args.nnodes.split(":"))
    replicas = find(rendered, "StatefulSet", "trainer")["spec"]["replicas"]
    assert 1 <= minimum <= replicas <= maximum, "replicas outside MIN:MAX"
    assert args.rdzv_backend == "etcd-v3"
    assert (REPO / args.training_script).is_file(), f"{args.training_script} is not a recipe of this repository"
    assert args.training_script.startswith("recipes/")

    import sys

    sys.path.insert(0, str(REPO / "recipes"))
    import gpt

    recipe = gpt.build_parser().parse_args(args.training_script_args)  # exits 2 on a bad flag
    mounts = {m["mountPath"] for m in pod.container["volumeMounts"]}
    assert any(recipe.ckpt_dir.startswith(m + "/") for m in mounts), "checkpoints are not on a volume"
    claims = {v["name"]: v for v in pod_spec(pod.workload)["volumes"]}
    ckpt_volume = next(m["name"] for m in pod.container["volumeMounts"] if recipe.ckpt_dir.startswith(m["mountPath"]))
    claim = find(rendered, "PersistentVolumeClaim", claims[ckpt_volume]["persistentVolumeClaim"]["claimName"])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every trainer pod mounts the checkpoints at once"

    # Metrics: the flag, the containerPort named metrics, the scrape annotations agree.
    metrics_port = {p["name"]: p["containerPort"] for p in pod.container["ports"]}["metrics"]
    assert recipe.metrics_port == metrics_port and recipe.metrics_host == "0.0.0.0"
    annotations = find(rendered, "StatefulSet", "trainer")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port) and annotations["prometheus.io/scrape"] == "true"

    # The SIGTERM checkpoint fits: the worker's grace < torchrun's wait for its workers
    # before SIGKILL (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s) < the pod's grace period.
    torchrun_wait = int(pod.environment().get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    grace = pod_spec(pod.workload)["terminationGracePeriodSeconds"]
    assert recipe.term_grace + 10 <= torchrun_wait <= grace - 10, (recipe.term_grace, torchrun_wait, grace)


def test_the_etcd_endpoint_is_the_etcd_client_service(rendered: list[dict[str, Any]]) -> None:
    args = get_args_parser().parse_args(trainer(rendered).argv()[1:])
    host, _, port = args.rdzv_endpoint.partition(":")
    service = find(rendered, "Service", host)
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    etcd = find(rendered, "StatefulSet", "etcd")
    assert service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
    etcd_pod = PodProcess(rendered, etcd, "etcd-0", mounts={}, use_entrypoint=False)
    flags = etcd_flags(etcd_pod)
    assert f":{port}" in flags["listen-client-urls"]
    assert "enable-v2" not in flags, "v3 API only"
    members = dict(m.split("=", 1) for m in flags["initial-cluster"].split(","))
    assert set(members) == {f"etcd-{i}" for i in range(etcd["spec"]["replicas"])}
    assert flags["initial-advertise-peer-urls"] == members["etcd-0"], "the member advertises what the cluster lists"
    mounts = {m["mountPath"] for m in etcd_pod.container["volumeMounts"]}
    assert any(flags["data-dir"].startswith(m) for m in mounts), "etcd data is not on its volume"
    (claim,) = etcd["spec"]["volumeClaimTemplates"]
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and int(flags["quota-backend-bytes"]) < int(size[:-2]) * 2**30, "quota beyond the volume"


def test_network_policies_select_real_pods_and_name_real_ports(rendered: list[dict[str, Any]]) -> None:
    pods = {o["metadata"]["name"]: o for o in workloads(rendered)}

    def selected(selector: dict[str, Any]) -> list[str]:
        return [n for n, w in pods.items()
                if selector["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]

    policies = [o for o in rendered if o["kind"] == "NetworkPolicy"]
    assert {name for p in policies for name in selected(p["spec"]["podSelector"])} == set(pods), "a workload is unguarded"
    for policy in policies:
        (target,) = selected(policy["spec"]["podSelector"])
        ports = {p["name"] for c in pod_spec(pods[target])["containers"] for p in c.get("ports", [])}
        for rule in policy["spec"]["ingress"]:
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule admits every source"
            for peer in rule["from"]:
                if "namespaceSelector" in peer:  # pods of another namespace: not ours to check here
                    continue
                assert selected(peer["podSelector"]), f"{policy['metadata']['name']}: a rule admits no pod"
            for port in rule.get("ports", []):
                assert port["port"] in ports, f"{policy['metadata']['name']}: no port {port['port']} on {target}"
    trainer_rules = next(p for p in policies if selected(p["spec"]["podSelector"]) == ["trainer"])["spec"]["ingress"]
    assert any(selected(peer["podSelector"]) == ["trainer"] and "ports" not in rule
               for rule in trainer_rules for peer in rule.get("from", [])), "trainers must reach each other on any port"
    # The metrics port: only from the Prometheus pods of the monitoring namespace (both
    # selectors in one peer, which Kubernetes ANDs), and no other outside source at all.
    outside = [(peer, rule) for rule in trainer_rules for peer in rule["from"] if "namespaceSelector" in peer]
    assert outside, "nothing outside the job may scrape the metrics"
    for peer, rule in outside:
        assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
        assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
        assert [p["port"] for p in rule["ports"]] == ["metrics"], "Prometheus reaches the metrics port only"


def test_pods_run_as_non_root_without_privileges(rendered: list[dict[str, Any]]) -> None:
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]


def test_gpus_are_requested_in_the_base_and_not_in_the_cpu_overlay() -> None:
    def gpu_and_device(directory: Path) -> tuple[dict[str, Any], str]:
        objects = build(directory)
        resources = trainer(objects).container["resources"]
        return resources, find(objects, "ConfigMap", "trainer-config")["data"]["DEVICE"]

    base, device = gpu_and_device(K8S)
    assert base["limits"]["nvidia.com/gpu"] == base["requests"]["nvidia.com/gpu"] == 1 and device == "cuda"
    nproc = int(find(build(K8S), "ConfigMap", "trainer-config")["data"]["NPROC_PER_NODE"])
    assert nproc == base["limits"]["nvidia.com/gpu"], "one worker per GPU"
    cpu, device = gpu_and_device(K8S / "overlays" / "cpu")
    assert "nvidia.com/gpu" not in str(cpu) and device == "cpu"


def test_the_dockerfile_builds_what_the_manifests_run() -> None:
    instructions = dockerfile_instructions()
    assert re.match(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-", instructions[0][1]), "a CUDA runtime base"
    assert (REPO / image_entrypoint()[0].replace("/app/", "deploy/k8s/")).exists()
    for word, rest in instructions:
        if word == "COPY":
            *sources, _ = rest.split()
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1].split(":")[0] == str(pod_spec(find(build(K8S), "StatefulSet", "trainer"))["securityContext"]["runAsUser"])
    installs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert "pip install" in installs and "vision" in installs, "the package and its vision extra"
    assert DOCKERFILE.parent == K8S


# --- etcd on TLS, Secrets as files, final exits --------------------------------------------------

MAKE_CERTS = K8S / "make-etcd-certs.sh"
TLS_FILES = {"ca.crt", "tls.crt", "tls.key"}
"""The files make-etcd-certs.sh puts in each Secret's folder (the Secret's keys)."""


def etcd_flags(pod: PodProcess) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in pod.argv()[1:])


def secret_mounts(workload: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """mountPath -> (Secret name, the mount) for the workload's container."""
    spec = pod_spec(workload)
    secrets = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    return {m["mountPath"]: (secrets[m["name"]]["secretName"], m)
            for m in spec["containers"][0]["volumeMounts"] if m["name"] in secrets}


def secret_file(workload: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the Secret file at `path` in the workload's container."""
    for mount_path, (secret, _) in secret_mounts(workload).items():
        if path.startswith(mount_path + "/"):
            return secret, path[len(mount_path) + 1:]
    raise AssertionError(f"{path} is not in a Secret mounted by {workload['metadata']['name']}")


def created_secrets() -> dict[str, set[str]]:
    """Secret name -> its keys, as the kubectl commands make-etcd-certs.sh prints create them."""
    made = {}
    for name, source in re.findall(r"create secret generic (\S+) --from-file=(\S+)", MAKE_CERTS.read_text()):
        made[name] = {source.split("=")[0]} if "=" in source else TLS_FILES  # a folder: one key per file
    return made


def test_etcd_serves_only_tls_clients_with_a_certificate(rendered: list[dict[str, Any]]) -> None:
    etcd = find(rendered, "StatefulSet", "etcd")
    pod = PodProcess(rendered, etcd, "etcd-0", mounts={}, use_entrypoint=False)
    flags = etcd_flags(pod)
    for urls in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
        assert all(u.startswith("https://") for u in flags[urls].split(",")), f"{urls}: {flags[urls]}"
    assert flags["client-cert-auth"] == flags["peer-client-cert-auth"] == "true"
    files = {flags[f] for f in ("cert-file", "key-file", "trusted-ca-file")}
    assert files == {flags[f"peer-{f}"] for f in ("cert-file", "key-file", "trusted-ca-file")}
    assert {secret_file(etcd, f) for f in files} == {("etcd-server-tls", f) for f in TLS_FILES}
    # The kubelet has no client certificate: the probes ask a plain-http port serving only /health and /metrics.
    health = {p["name"]: p["containerPort"] for p in pod.container["ports"]}[pod.container["readinessProbe"]["httpGet"]["port"]]
    assert flags["listen-metrics-urls"] == f"http://0.0.0.0:{health}"
    assert pod.container["livenessProbe"]["httpGet"]["port"] == pod.container["readinessProbe"]["httpGet"]["port"]


def test_the_trainer_reaches_etcd_with_its_client_certificate(rendered: list[dict[str, Any]]) -> None:
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    pod = trainer(rendered)
    conf = _parse_rendezvous_config(get_args_parser().parse_args(pod.argv()[1:]).rdzv_conf)
    assert conf["protocol"] == "https"
    files = {secret_file(pod.workload, conf[option]) for option in ("ca_cert", "ssl_cert", "ssl_cert_key")}
    assert files == {("etcd-client-tls", "ca.crt"), ("etcd-client-tls", "tls.crt"), ("etcd-client-tls", "tls.key")}


def test_secrets_are_read_only_files_that_the_documented_commands_create(rendered: list[dict[str, Any]]) -> None:
    made = created_secrets()
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    assert "deploy/k8s/make-etcd-certs.sh" in docs
    assert not [o for o in rendered if o["kind"] == "Secret"], "no Secret (nor a placeholder) ships in the manifests"
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        for volume in (v for v in spec.get("volumes", []) if "secret" in v):
            assert volume["secret"]["secretName"] in made, f"nothing documented creates {volume['secret']['secretName']}"
            assert volume["secret"]["defaultMode"] & 0o007 == 0, "a Secret's files are not for every user"
        for _, (secret, mount) in secret_mounts(workload).items():
            assert mount.get("readOnly") is True, f"{secret} is mounted writable"
        for item in spec["containers"][0].get("env", []):
            assert "secretKeyRef" not in item.get("valueFrom", {}), "secrets reach the job as files, not env values"
    pod = trainer(rendered)
    secret, key = secret_file(pod.workload, pod.environment()["TORCHREVIVE_SNAPSHOT_SECRET_FILE"])
    assert secret == "torchrevive-snapshot-secret" and key in made[secret]
    assert f"create secret generic {secret} --from-file={key}=<(openssl rand -hex 32)" in docs


def test_no_password_in_any_manifest() -> None:
    for path in [*K8S.rglob("*.yaml"), K8S / "entrypoint.sh"]:
        assert "password" not in path.read_text().lower(), f"{path.relative_to(REPO)} mentions a password"
    for directory in KUSTOMIZATIONS:
        for obj in build(directory):
            assert "password" not in str(obj).lower()


def test_a_final_exit_idles_the_pod_not_ready_instead_of_restarting_it(rendered: list[dict[str, Any]]) -> None:
    from elastic._shared.common.errors import CheckpointStorageError, UsageError

    pod = trainer(rendered)
    env = pod.environment()
    from elastic._agent.launcher.failure_policy import CRASH_LOOP_EXIT, SET_ASIDE_EXIT

    finals = set(env["FINAL_EXIT_CODES"].split())
    assert {str(UsageError.exit_code), str(CheckpointStorageError.exit_code), str(CRASH_LOOP_EXIT)} <= finals
    assert str(SET_ASIDE_EXIT) not in finals, "a node set aside restarts and rejoins after its cool-off"
    assert f"{CRASH_LOOP_EXIT}) why=" in (REPO / "deploy" / "k8s" / "entrypoint.sh").read_text()
    mark = env["STOPPED_MARK"]
    assert any(mark.startswith(m["mountPath"] + "/") for m in pod.container["volumeMounts"]), "the mark is on a volume"
    assert pod.container["readinessProbe"]["exec"]["command"] == ["sh", "-c", 'test ! -e "$STOPPED_MARK"']
    assert "livenessProbe" not in pod.container, "a hung worker is the watchdog's: no liveness probe"
    # Readiness says only "stopped": the pods' names resolve from their start, and a drain is never blocked.
    assert find(rendered, "Service", "trainer")["spec"]["publishNotReadyAddresses"] is True
    assert find(rendered, "PodDisruptionBudget", "trainer")["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
