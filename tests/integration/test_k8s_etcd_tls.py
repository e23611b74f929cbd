"""The manifests' etcd flags are real: etcd started with them, on certificates the documented
script makes, serves the trainer's rendezvous options and refuses a client without a certificate."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
import uuid
from pathlib import Path

import pytest
from kube import K8S, PodProcess, build, find, local_executables
from support import free_port, wait_for
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config
from torch.distributed.run import get_args_parser

from elastic._agent.rendezvous.etcd import create_backend
from elastic._agent.rendezvous.etcd_options import EtcdOptionsError

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian package etcd-server)")


def make_certs(directory: Path) -> Path:
    """deploy/k8s/make-etcd-certs.sh, run as docs/kubernetes.md says."""
    done = subprocess.run(["sh", str(K8S / "make-etcd-certs.sh"), str(directory)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "create secret generic etcd-server-tls" in done.stdout
    return directory


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return b'"health":"true"' in response.read()
    except OSError:
        return False


def trainer_params(trainer: PodProcess, **changes: str | None) -> RendezvousParameters:
    """The rendezvous parameters torchrun builds from the trainer's own command line, mapped locally."""
    args = get_args_parser().parse_args(trainer.local_argv()[1:])
    conf = {k: v for k, v in {**_parse_rendezvous_config(args.rdzv_conf), **changes}.items() if v is not None}
    return RendezvousParameters("etcd-v3", args.rdzv_endpoint, uuid.uuid4().hex, 1, 1, read_timeout="5", **conf)


def test_etcd_runs_with_the_manifests_flags_and_admits_only_the_trainers_certificate(tmp_path: Path) -> None:
    pki = make_certs(tmp_path / "pki")
    objects = build(K8S)
    ports = {2379: free_port(), 2380: free_port(), 2381: free_port()}
    network = {"hosts": {"etcd-client": "127.0.0.1", "etcd-0.etcd": "127.0.0.1"}, "ports": ports,
               "executables": local_executables()}
    etcd = PodProcess(objects, find(objects, "StatefulSet", "etcd"), "etcd-0", use_entrypoint=False,
                      mounts={"/var/lib/etcd": tmp_path / "etcd", "/etc/etcd/tls": pki / "etcd-server"}, **network)
    trainer = PodProcess(objects, find(objects, "StatefulSet", "trainer"), "trainer-0", use_entrypoint=False,
                         mounts={"/etc/torchrevive/etcd-tls": pki / "etcd-client"}, **network)
    (tmp_path / "etcd").mkdir()
    process = etcd.start(tmp_path / "etcd.log", {})
    try:
        probe = etcd.container["readinessProbe"]["httpGet"]
        probe_port = {p["name"]: p["containerPort"] for p in etcd.container["ports"]}[probe["port"]]
        wait_for(lambda: process.poll() is None and healthy(f"http://127.0.0.1:{ports[probe_port]}{probe['path']}"),
                 30, f"etcd's readiness probe\n{(tmp_path / 'etcd.log').read_text()[-3000:]}")

        backend, store = create_backend(trainer_params(trainer))
        try:
            _, token, written = backend.set_state(b"state")
            store.set("k", "v")
            assert written and backend.get_state() == (b"state", token) and store.get("k") == b"v"
        finally:
            backend.client.close()

        for missing in ({"ssl_cert": None, "ssl_cert_key": None},):
            with pytest.raises(RendezvousConnectionError, match="TLS failed"):
                create_backend(trainer_params(trainer, **missing))
        with pytest.raises(RendezvousConnectionError, match=r"cannot reach etcd .*add protocol=https"):
            create_backend(trainer_params(trainer, protocol=None, ca_cert=None, ssl_cert=None, ssl_cert_key=None))
        # A certificate of another CA (someone else's script run) is refused as well.
        other = make_certs(tmp_path / "other-pki") / "etcd-client"
        with pytest.raises(RendezvousConnectionError, match="TLS failed"):
            create_backend(trainer_params(trainer, ssl_cert=str(other / "tls.crt"), ssl_cert_key=str(other / "tls.key")))
        with pytest.raises(EtcdOptionsError, match="password_file"):
            create_backend(trainer_params(trainer, user="root", password="x"))
    finally:
        process.terminate()
        process.wait(20)


def test_the_script_refuses_to_overwrite_and_bad_arguments_in_one_line(tmp_path: Path) -> None:
    script = str(K8S / "make-etcd-certs.sh")
    make_certs(tmp_path / "pki")
    for args in ([str(tmp_path / "pki")], [], [str(tmp_path / "new"), "Bad_Namespace"], [str(tmp_path / "n2"), "ns", "x"]):
        done = subprocess.run(["sh", script, *args], capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, (args, done.stderr)
    assert not (tmp_path / "new").exists() and not (tmp_path / "n2").exists()
    assert oct((tmp_path / "pki" / "etcd-client" / "tls.key").stat().st_mode & 0o777) == "0o600"
