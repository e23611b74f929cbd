"""A proxy in front of a local S3 server that answers chosen requests with an error of its own.

    with FlakyS3(server.url) as proxy:
        proxy.fail = lambda method, path: method == "PUT"      # every upload refused
        proxy.status, proxy.code = 503, "SlowDown"             # as a throttled S3 answers
        proxy.drop = lambda method, path: True                 # the server gone: connections closed
        proxy.trickle = lambda method, path: 0.5               # the answer's body a byte every 0.5 s
        ... point AWS_ENDPOINT_URL at proxy.url ...

Runs in the test's process (threads), on a loopback port; `failed` counts the errors it served.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class FlakyS3:
    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.fail: Callable[[str, str], bool] = lambda method, path: False
        self.status, self.code = 503, "SlowDown"
        self.failed = 0
        self.drop: Callable[[str, str], bool] = lambda method, path: False
        """Requests answered by closing the connection, as a server that went away mid-request."""
        self.dropped = 0
        self.trickle: Callable[[str, str], float | None] = lambda method, path: None
        """Seconds between the bytes of an answer's body (None: all at once), as a server that stalls."""
        self.trickled = 0
        """Bytes of trickled bodies sent so far."""
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    body = self._read_chunked()
                if proxy.drop(self.command, self.path):
                    with proxy._lock:
                        proxy.dropped += 1
                    self.close_connection = True
                    return
                if proxy.fail(self.command, self.path):
                    with proxy._lock:
                        proxy.failed += 1
                    error = (f"<?xml version='1.0'?><Error><Code>{proxy.code}</Code>"
                             f"<Message>injected</Message></Error>").encode()
                    self.send_response(proxy.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding",)}
                headers["Content-Length"] = str(len(body))
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(key, value)
                # A HEAD's length is the object's, not its (empty) body's.
                self.send_header("Content-Length", answer.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                pause = proxy.trickle(self.command, self.path)
                if pause is None:
                    self.wfile.write(data)
                else:
                    for at in range(len(data)):
                        self.wfile.write(data[at:at + 1])
                        self.wfile.flush()
                        with proxy._lock:
                            proxy.trickled += 1
                        time.sleep(pause)
                upstream.close()

            def _read_chunked(self) -> bytes:
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="flaky-s3", daemon=True)

    def __enter__(self) -> FlakyS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
