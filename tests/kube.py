"""The Kubernetes manifests, offline: render them, and run a pod's container as a local process.

No cluster runs on these machines. `render()` uses `kubectl kustomize` when
kubectl is on PATH and otherwise a reader of the kustomization subset this
project uses (resources, namespace, images, JSON 6902 patches); anything else
in a kustomization is refused rather than ignored, so the fallback never
renders something different in silence (a test compares the two where
kubectl exists).

`PodProcess` turns a rendered pod template into what the kubelet would run:
the image's entrypoint (from the Dockerfile) and the container's command and
args, `$(VAR)` expanded from its env and ConfigMaps as the kubelet does, the
downward API's pod name, volume mounts (Secrets included) mapped to local
folders in the arguments and the environment, service host names and ports
mapped to loopback ones.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from support import REPO

K8S = REPO / "deploy" / "k8s"
DOCKERFILE = K8S / "Dockerfile"
KUSTOMIZATIONS = [K8S, K8S / "overlays" / "cpu", K8S / "overlays" / "monitoring"]

# Kinds that are not namespaced (kustomize's namespace transformer leaves them alone).
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass"}
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}


class KustomizeError(Exception):
    pass


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(directory: Path, *, use_kubectl: bool | None = None) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` produces (by kubectl when there, else the fallback)."""
    if use_kubectl is None:
        use_kubectl = kubectl() is not None
    if use_kubectl:
        out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, check=True)
        return [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    return build(directory)


# -- the fallback kustomize -----------------------------------------------------


def build(directory: Path) -> list[dict[str, Any]]:
    """Render one kustomization directory (the subset in SUPPORTED_KEYS)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{directory}/kustomization.yaml uses {sorted(unknown)}, which the fallback cannot render")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in spec.get("patches", []):
        operations = yaml.safe_load((directory / patch["path"]).read_text())
        if not isinstance(operations, list):
            raise KustomizeError(f"{patch['path']}: only JSON 6902 patches (a list of operations) are supported")
        targets = [o for o in objects if matches(o, patch["target"])]
        if not targets:
            raise KustomizeError(f"patch {patch['path']}: no object matches {patch['target']}")
        for target in targets:
            for op in operations:
                apply_json6902(target, op)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for container in containers(objects):
            name, _, _ = container["image"].partition(":")
            if name == image["name"]:
                new = image.get("newName", name)
                if "digest" in image:
                    container["image"] = f"{new}@{image['digest']}"
                else:
                    container["image"] = f"{new}:{image.get('newTag', container['image'].partition(':')[2] or 'latest')}"
    return objects


def matches(obj: dict[str, Any], target: Mapping[str, str]) -> bool:
    return all(
        (obj.get("kind") if key == "kind" else obj.get("metadata", {}).get(key)) == value
        for key, value in target.items()
    )


def apply_json6902(doc: Any, op: Mapping[str, Any]) -> None:
    """add, replace and remove (RFC 6902), enough for the overlays."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    parent = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if op["op"] in ("add", "replace"):
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if op["op"] == "add":
                parent.insert(index, op["value"])
            else:
                parent[index] = op["value"]
        else:
            if op["op"] == "replace" and last not in parent:
                raise KustomizeError(f"replace {op['path']}: nothing there")
            parent[last] = op["value"]
    elif op["op"] == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    else:
        raise KustomizeError(f"JSON 6902 op {op['op']!r} is not supported by the fallback")


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    spec = obj.get("spec", {})
    if obj.get("kind") == "Pod":
        return spec
    return spec.get("template", {}).get("spec")


def containers(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for obj in objects:
        spec = pod_spec(obj)
        if spec:
            yield from spec.get("initContainers", [])
            yield from spec.get("containers", [])


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# -- the image ------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def image_entrypoint() -> list[str]:
    (entry,) = [rest for word, rest in dockerfile_instructions() if word == "ENTRYPOINT"]
    return json.loads(entry)


def image_workdir() -> str:
    return [rest for word, rest in dockerfile_instructions() if word == "WORKDIR"][-1]


# -- a pod as a process ---------------------------------------------------------

_VAR = re.compile(r"\$\((\w+)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, others kept as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class PodProcess:
    """What the kubelet would run for `pod_name` from a rendered workload, mapped onto this machine."""

    objects: list[dict[str, Any]]
    workload: dict[str, Any]
    pod_name: str
    mounts: dict[str, Path]
    """mountPath -> local folder (volumes the test provides)."""
    hosts: dict[str, str] = field(default_factory=dict)
    """service host name (as the manifests write it) -> local address."""
    ports: dict[int, int] = field(default_factory=dict)
    """port in the manifests -> local port."""
    config_overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    """ConfigMap name -> keys changed, as a user would edit the ConfigMap."""
    executables: dict[str, str] = field(default_factory=dict)
    """program name -> local path (the image's venv is this machine's)."""
    use_entrypoint: bool = True

    @property
    def container(self) -> dict[str, Any]:
        return pod_spec(self.workload)["containers"][0]

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            ref = source["configMapRef"]["name"]
            env.update(self.config_map(ref))
        for item in self.container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            elif "fieldRef" in item.get("valueFrom", {}):
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                env[item["name"]] = {"metadata.name": self.pod_name,
                                     "metadata.namespace": self.workload["metadata"].get("namespace", "default")}[path]
            elif "configMapKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["configMapKeyRef"]
                env[item["name"]] = self.config_map(ref["name"])[ref["key"]]
        return env

    def config_map(self, name: str) -> dict[str, str]:
        data = dict(find(self.objects, "ConfigMap", name).get("data", {}))
        data.update(self.config_overrides.get(name, {}))
        return data

    def argv(self) -> list[str]:
        """The container's command line as the kubelet would start it (variables expanded)."""
        env = self.environment()
        words = [expand(w, env) for w in self.container.get("command", [])]
        if not words:  # no command: the image's entrypoint runs the args
            words = image_entrypoint() if self.use_entrypoint else []
        return words + [expand(w, env) for w in self.container.get("args", [])]

    def local_argv(self) -> list[str]:
        """`argv()` mapped onto this machine: mounts, service addresses, programs."""
        return [self.localize(w, index) for index, w in enumerate(self.argv())]

    def localize(self, word: str, index: int) -> str:
        if index == 0 and word == "/app/entrypoint.sh":
            return str(K8S / "entrypoint.sh")
        if word in self.executables:
            return self.executables[word]
        word = self.localize_paths(word)
        for host, local in self.hosts.items():
            for port, local_port in self.ports.items():
                word = re.sub(rf"\b{re.escape(host)}:{port}\b", f"{local}:{local_port}", word)
            word = re.sub(rf"(?<=//){re.escape(host)}(?=[:/]|$)", local, word)
        for port, local_port in self.ports.items():
            word = re.sub(rf"(?<=0\.0\.0\.0:){port}\b", str(local_port), word)
        return word.replace("0.0.0.0", "127.0.0.1")

    def localize_paths(self, word: str) -> str:
        """Mount paths in `word` mapped to their local folders, in one pass (a local folder
        that itself starts like a mount path, /tmp/..., is not mapped again)."""
        if not self.mounts:
            return word
        paths = sorted(self.mounts, key=len, reverse=True)
        pattern = "|".join(re.escape(p) for p in paths)
        return re.sub(rf"(?<![\w/])({pattern})(?=/|$|\b)", lambda m: str(self.mounts[m.group(1)]), word)

    def local_environment(self) -> dict[str, str]:
        """`environment()` with mount paths mapped to local folders (files the env names)."""
        return {name: self.localize_paths(value) for name, value in self.environment().items()}

    def working_dir(self) -> Path:
        where = self.container.get("workingDir") or image_workdir()
        assert where == "/app", f"the recipes are in /app in the image, the container runs in {where}"
        return REPO

    def start(self, log: Path, extra_env: Mapping[str, str]) -> subprocess.Popen:
        env = {**os.environ, **self.local_environment(), **extra_env}
        with open(log, "ab") as out:
            out.write(f"$ {shlex.join(self.local_argv())}\n".encode())
            return subprocess.Popen(
                self.local_argv(), cwd=self.working_dir(), env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # the pod's process tree, to delete as one
            )


def local_executables() -> dict[str, str]:
    """The programs the image's PATH holds, from this interpreter's environment."""
    bin_dir = Path(sys.executable).parent
    found = {}
    for name in ("torchrun", "torchrevive-run", "python", "etcd"):
        local = bin_dir / name
        found[name] = str(local) if local.exists() else (shutil.which(name) or name)
    return found
