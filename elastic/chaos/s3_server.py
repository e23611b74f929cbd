"""A local S3-compatible server for the tests and benchmarks: moto's server mode on a free loopback port.

    with S3Server(log=Path("/tmp/s3.log")) as server:
        env = server.environment()          # AWS_ENDPOINT_URL, test credentials, region
        server.create_bucket("bucket1")

Why moto: a pure-Python package from PyPI (nothing to download at run time),
and it enforces the conditional writes the commit rests on, which many S3
emulators silently ignore: a second PutObject with `If-None-Match: *` is
refused (412), as is `If-Match` with a stale ETag
(tests/integration/test_object_store.py proves both before anything else).
Its objects live in the server's memory: a restart empties it.

Invariants:
- It listens on 127.0.0.1 only, on a port `free_port` picked (below the
  ephemeral range), and is stopped (SIGTERM, then SIGKILL) on `stop`/exit.
- The credentials it is given are throwaway values for this server alone,
  passed to clients through the environment, never on a command line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from elastic._shared.common.errors import UsageError
from elastic.chaos.netns import free_port

TEST_KEY_ID = "torchrevive-test"
TEST_SECRET = "torchrevive-test-secret"
REGION = "us-east-1"


class S3Server:
    """moto's S3 server as a child process (see the module docstring)."""

    def __init__(self, *, log: Path | None = None) -> None:
        self.port = free_port()
        self.log = log
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self, **extra: str) -> dict[str, str]:
        """What a client of this server needs in its environment (and nothing from the caller's AWS setup)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(
            AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID=TEST_KEY_ID, AWS_SECRET_ACCESS_KEY=TEST_SECRET,
            AWS_REGION=REGION, AWS_EC2_METADATA_DISABLED="true",
        )
        env.update(extra)
        return env

    def start(self, timeout: float = 60) -> None:
        try:
            import moto.server  # noqa: F401 - only to say what is missing
        except ImportError:
            raise UsageError("the local S3 server needs moto[server] (pip install -e '.[test]')") from None
        out = open(self.log, "ab") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env=self.environment(),
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the S3 server exited with {self._process.returncode} (log: {self.log})")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"the S3 server did not listen on {self.url} within {timeout:g} s")

    def client(self):  # noqa: ANN201 - a boto3 S3 client
        import boto3

        return boto3.session.Session().client(
            "s3", endpoint_url=self.url, aws_access_key_id=TEST_KEY_ID, aws_secret_access_key=TEST_SECRET,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
