"""The snapshot keeper's HTTP endpoint: what peers may ask of a node's keeper, and where it binds.

    GET /part/<local|replica>/<part file>   a part's data or header, whole or one `Range: bytes=a-b`
    PUT /replica/<part stem>                a peer's part: `X-Header-Bytes` of JSON header, then the data

Invariants:
- Only part files are served, by name (no paths): a name that is not a part's is 404.
- A PUT's header is read within its declared length (at most 64 MiB) and checked
  against its name and data length before any data is stored; a malformed
  request is 400 and its connection closed (the unread body is never parsed
  as a request); a full store is 507.
- Nothing it serves or stores is ever executed: data and JSON only.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from elastic.errors import CorruptCheckpoint
from elastic.storage import parts
from elastic.storage.keeper_address import HEADER_BYTES, LOCAL, REPLICA

logger = logging.getLogger(__name__)

HOST_ENV = "TORCHREVIVE_SNAPSHOT_HOST"
"""Where keepers bind, when set (else the agent's --local-addr, else the address that reaches the rendezvous)."""


class PartHolder(Protocol):
    """What the endpoint needs of a keeper."""

    root: Path
    """Its directory: parts under root/local and root/replica."""

    def receive(self, stem: str, head: bytes, body: BinaryIO, length: int) -> None:
        """Store a peer's part (`ValueError` or `CorruptCheckpoint`: malformed; `OSError`: no room)."""
        ...


def serve(keeper: PartHolder, host: str) -> ThreadingHTTPServer:
    """An HTTP server for `keeper` on `host`, on a port the system picks (not yet serving:
    run its `serve_forever`)."""
    server = ThreadingHTTPServer((host, 0), _Handler)
    server.daemon_threads = True
    server.keeper = keeper  # type: ignore[attr-defined]
    return server


class _Handler(BaseHTTPRequestHandler):
    """GET /part/<local|replica>/<part file> (whole, or one `Range: bytes=a-b`); PUT /replica/<part stem>
    (header, then data)."""

    protocol_version = "HTTP/1.1"
    timeout = 120  # seconds a stalled peer may hold a connection (and its temporary file)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        keeper: PartHolder = self.server.keeper  # type: ignore[attr-defined]
        pieces = self.path.strip("/").split("/")
        if len(pieces) != 3 or pieces[0] != "part" or pieces[1] not in (LOCAL, REPLICA) or parts.parse_part_name(pieces[2]) is None:
            self.send_error(404)
            return
        path = keeper.root / pieces[1] / pieces[2]
        try:
            f = open(path, "rb")
        except OSError:
            self.send_error(404)
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            start, stop = 0, size
            wanted = self.headers.get("Range")
            if wanted is not None:  # "bytes=first-last", the only form peers send
                match = re.fullmatch(r"bytes=(\d+)-(\d+)", wanted.strip())
                if match is None or int(match[1]) > int(match[2]) or int(match[1]) >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, stop = int(match[1]), min(int(match[2]) + 1, size)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(stop - start))
            self.end_headers()
            f.seek(start)
            remaining = stop - start
            while remaining:
                block = f.read(min(remaining, 2**20))
                if not block:  # the file shrank: the peer sees a short body and tries elsewhere
                    self.close_connection = True
                    break
                self.wfile.write(block)
                remaining -= len(block)

    def do_PUT(self) -> None:  # noqa: N802
        keeper: PartHolder = self.server.keeper  # type: ignore[attr-defined]
        pieces = self.path.strip("/").split("/")
        try:
            total = int(self.headers["Content-Length"])
            head_bytes = int(self.headers[HEADER_BYTES])
        except (TypeError, ValueError):
            self.send_error(400)
            self.close_connection = True  # the unread body must not be parsed as a request
            return
        if len(pieces) != 2 or pieces[0] != REPLICA or parts.parse_part_name(pieces[1] + parts.HEADER_SUFFIX) is None \
                or not 0 < head_bytes <= min(total, 2**26):
            self.send_error(400)
            self.close_connection = True
            return
        try:
            keeper.receive(pieces[1], self.rfile.read(head_bytes), self.rfile, total - head_bytes)
        except (ValueError, CorruptCheckpoint) as exc:
            self.send_error(400, str(exc)[:200])
            self.close_connection = True
            return
        except OSError as exc:
            self.send_error(507, str(exc)[:200])
            self.close_connection = True
            return
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        logger.debug("snapshot keeper: " + format, *args)


def keeper_host(local_addr: str | None, rdzv_endpoint: str | None = None, environ: dict[str, str] | None = None) -> str:
    """Where the keeper binds: TORCHREVIVE_SNAPSHOT_HOST, else the agent's `--local-addr`, else the
    address this host reaches the rendezvous endpoint from (the one its peers reach it by; a
    host name that resolves to loopback, as Debian's 127.0.1.1 does, would cut replicas off)."""
    env = os.environ if environ is None else environ
    if env.get(HOST_ENV):
        return env[HOST_ENV]
    if local_addr:
        return local_addr
    host = (rdzv_endpoint or "").rsplit(":", 1)[0].strip("[]") if rdzv_endpoint else ""
    if host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))  # no packet is sent: only the route is looked up
                return probe.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"
