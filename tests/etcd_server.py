"""Test helpers around `elastic.chaos.etcd.EtcdServer`: a PKI for TLS tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

from elastic.chaos.etcd import EtcdServer, Tls

__all__ = ["EtcdServer", "Tls", "login_conf", "make_tls"]


def make_tls(directory: Path) -> Tls:
    """A CA, and server and client certificates it signed, for 127.0.0.1 (openssl)."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-subj", "/CN=torchrevive test CA")
    # etcd's JSON gateway dials etcd's own gRPC port with the server certificate,
    # so under --client-cert-auth that certificate must be good for clients too.
    for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(
            f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n"
        )
        # No Common Name on the client: with auth on, etcd's gateway refuses client
        # certificates that carry one (a CN cannot become the user through it).
        subject = "/CN=server" if name == "server" else "/O=torchrevive test client"
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", subject)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return Tls(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


def login_conf(tls: Tls, password: str, directory: Path, user: str = "root") -> dict[str, str]:
    """rdzv-conf options that log `user` in over TLS with a client certificate, the password
    in a file (the only way the rendezvous takes one)."""
    password_file = directory / f"{user}-etcd-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    return {"protocol": "https", "ca_cert": str(tls.ca), "ssl_cert": str(tls.client_cert),
            "ssl_cert_key": str(tls.client_key), "user": user, "password_file": str(password_file)}
