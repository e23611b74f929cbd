"""The snapshot keeper's HTTP endpoint: what peers of the job may ask of a node's keeper, and where it binds.

    GET /part/<local|replica>/<part file>   a part's data, whole or one `Range: bytes=a-b`,
                                            then a 16-byte tag
    PUT /replica/<part stem>                a peer's part: `X-Header-Bytes` of JSON header, then
                                            the data, then a 16-byte tag

Invariants:
- Every request is signed with the job's secret for this keeper (storage.peer_auth:
  the signature names the `host:port` of its URL) and judged before any of its
  body is read: unsigned is 401; a wrong signature (one for another keeper
  included), a stale time or a replayed nonce is 403. Every body carries a tag, checked in full
  before a byte of it is used; every answer carries one bound to its request.
- Only part files are served, by name (no paths): a name that is not a part's is 404.
- A PUT's header is at most `MAX_HEADER` bytes, its body exactly the declared
  part (the keeper checks the header's run, generation, world size and length
  before storing any data); a malformed request is 400 and its connection
  closed (the unread body is never parsed as a request); a store that would
  leave too little room is 507; a part for another run or generation is 409.
- At most `keeper_slots.MAX_CONNECTIONS` connections are served at once, and
  connections that have not yet carried a signed request give way to new ones
  (keeper_slots.py: at most `MAX_UNPROVEN_PER_ADDRESS` per source address, the
  oldest of the address holding the most evicted first); only when every slot
  carries the job's signed traffic is a new one answered 503 and closed. A
  connection's TLS handshake, request line and headers must
  arrive within `HEADER_SECONDS` of its start (or of the end of its previous
  request), however slowly they trickle, or it is shut down: only a signed
  request's body may take longer, and no read may stall `_Handler.timeout` seconds.
- Nothing it serves or stores is ever executed: data and JSON only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from elastic._agent.launcher.keeper_slots import Slots
from elastic._agent.timings import HEADER_SECONDS
from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage import parts, peer_auth
from elastic._shared.storage.keeper_address import HEADER_BYTES, LOCAL, REPLICA
from elastic._shared.storage.peer_auth import PeerKey, Refused, RequestVerifier

logger = logging.getLogger(__name__)

HOST_ENV = "TORCHREVIVE_SNAPSHOT_HOST"
"""Where keepers bind, when set (else the agent's --local-addr, else the address that reaches the rendezvous)."""
MAX_HEADER = 2**20
"""Bytes a part's JSON header may take."""


class Conflict(Exception):
    """A well-formed, signed part this keeper must not keep (another run, generation or world size): 409."""


class PartHolder(Protocol):
    """What the endpoint needs of a keeper."""

    root: Path
    """Its directory: parts under root/local and root/replica."""

    def receive(self, stem: str, head: bytes, body: BinaryIO, length: int, tag: Any) -> None:
        """Store a peer's part, fed through `tag` (a Poly1305) as it is read, and kept only if the body's
        last 16 bytes are its tag (`ValueError` or `CorruptCheckpoint`: malformed or forged; `Conflict`: not
        this job's; `OSError`: no room)."""
        ...


class _Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer whose connections hold slots (keeper_slots.Slots): at most MAX_CONNECTIONS."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits to be accepted (and judged) instead of being dropped

    def __init__(self, address: tuple[str, int], keeper: PartHolder, key: PeerKey, tls: ssl.SSLContext | None) -> None:
        self.keeper = keeper
        self.key = key
        self.tls = tls
        self.slots = Slots()
        self._deadlines: dict[socket.socket, float] = {}  # connection -> when its headers must be in
        self._deadline_lock = threading.Lock()
        self._raw = threading.local()  # the plain socket under this handler thread's connection
        super().__init__(address, _Handler)
        # The name its peers sign for: the host as its URL spells it (not the address it resolved to).
        self.verifier = RequestVerifier(key, peer_auth.receiver(address[0], self.server_address[1]))

    def expect_headers(self, by: float | None) -> None:
        """This thread's connection must have sent its headers by `by` (time.monotonic); None: it has."""
        raw = getattr(self._raw, "socket", None)
        if raw is None:
            return
        with self._deadline_lock:
            if by is None:
                self._deadlines.pop(raw, None)
            else:
                self._deadlines[raw] = by

    def shut_late_connections(self) -> None:
        """Shut down every connection whose headers are late (run every second by `serve`'s caller)."""
        now = time.monotonic()
        with self._deadline_lock:
            late = [raw for raw, by in self._deadlines.items() if by < now]
            for raw in late:
                del self._deadlines[raw]
        for raw in late:
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)  # its blocked read returns at once; the handler ends

    def proven(self) -> None:
        """This thread's connection carried a request signed by the job: it keeps its slot."""
        raw = getattr(self._raw, "socket", None)
        if raw is not None:
            self.slots.prove(raw)

    def process_request(self, request: Any, client_address: Any) -> None:
        admission = self.slots.admit(request, str(client_address[0]))
        for evicted in admission.evict:  # its blocked read returns at once; its handler ends
            logger.debug("snapshot keeper: a connection that sent no signed request gave way to a new one")
            with contextlib.suppress(OSError):
                evicted.shutdown(socket.SHUT_RDWR)
        if not admission.admitted:
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release(request)
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that hangs up mid-answer (a refused stranger, a reader that gave up) is one debug
        line, not socketserver's traceback in the agent's log."""
        logger.debug("snapshot keeper: a connection from %s ended: %s", client_address, sys.exc_info()[1])

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        request_socket = self._raw.socket = request
        try:
            self.expect_headers(time.monotonic() + HEADER_SECONDS)
            if self.tls is not None:
                request.settimeout(_Handler.timeout)
                request = self.tls.wrap_socket(request, server_side=True)
            super().process_request_thread(request, client_address)
        except (OSError, ssl.SSLError) as exc:
            logger.debug("snapshot keeper: a connection from %s failed: %s", client_address, exc)
        finally:
            self.expect_headers(None)
            self._raw.socket = None
            self.slots.release(request_socket)


def serve(keeper: PartHolder, host: str, key: PeerKey, tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    """An HTTP server for `keeper` on `host`, on a port the system picks, answering only requests
    signed with `key` (over TLS when `tls` is given), not yet serving: run its `serve_forever`."""
    return _Server((host, 0), keeper, key, tls)


class _Handler(BaseHTTPRequestHandler):
    """GET /part/<local|replica>/<part file> (whole, or one `Range: bytes=a-b`); PUT /replica/<part stem>
    (header, data, tag). See the module docstring."""

    protocol_version = "HTTP/1.1"
    timeout = 60  # seconds a stalled peer may hold a connection (and its temporary file)
    # An answer goes out as headers, then body: with Nagle's algorithm the body waits for the
    # peer's ACK of the headers, which a kept connection delays by 40 ms (delayed ACK).
    disable_nagle_algorithm = True
    server: _Server

    def handle_one_request(self) -> None:
        self.server.expect_headers(time.monotonic() + HEADER_SECONDS)  # the next request's, on a kept connection
        super().handle_one_request()

    def _refuse(self, status: int, why: str = "") -> None:
        self.send_error(status, why[:200] or None)
        self.close_connection = True  # an unread body must not be parsed as a request

    def _authenticated(self, method: str) -> str | None:
        """The request's nonce when it is signed by the job; else it is answered 401/403 here."""
        self.server.expect_headers(None)  # its headers are in
        try:
            nonce = self.server.verifier.check(method, self.path, self.headers)
            self.server.proven()
            return nonce
        except Refused as refused:
            logger.debug("snapshot keeper: refused %s %s from %s: %s", method, self.path, self.client_address[0], refused)
            self._refuse(refused.status)
            return None

    def do_GET(self) -> None:
        nonce = self._authenticated("GET")
        if nonce is None:
            return
        pieces = self.path.strip("/").split("/")
        if len(pieces) != 3 or pieces[0] != "part" or pieces[1] not in (LOCAL, REPLICA) or parts.parse_part_name(pieces[2]) is None:
            self.send_error(404)
            return
        path = self.server.keeper.root / pieces[1] / pieces[2]
        try:
            f = open(path, "rb")
        except OSError:
            self.send_error(404)
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            start, stop, status = 0, size, 200
            wanted = self.headers.get("Range")
            if wanted is not None:  # "bytes=first-last", the only form peers send
                match = re.fullmatch(r"bytes=(\d{1,19})-(\d{1,19})", wanted.strip())
                if match is None or int(match[1]) > int(match[2]) or int(match[1]) >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, stop, status = int(match[1]), min(int(match[2]) + 1, size), 206
            self.send_response(status)
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
            self.send_header("Content-Length", str(stop - start + peer_auth.TAG_BYTES))
            self.end_headers()
            tag = self.server.key.body_tag(nonce, peer_auth.response_what(self.path, status, start, stop, size))
            f.seek(start)
            remaining = stop - start
            while remaining:
                block = f.read(min(remaining, 2**20))
                if not block:  # the file shrank: the peer sees a short body and tries elsewhere
                    self.close_connection = True
                    return
                tag.update(block)
                self.wfile.write(block)
                remaining -= len(block)
            self.wfile.write(tag.finalize())

    def do_PUT(self) -> None:
        nonce = self._authenticated("PUT")
        if nonce is None:
            return
        pieces = self.path.strip("/").split("/")
        try:
            total = int(self.headers["Content-Length"])
            head_bytes = int(self.headers[HEADER_BYTES])
        except (TypeError, ValueError):
            self._refuse(400)
            return
        if len(pieces) != 2 or pieces[0] != REPLICA or parts.parse_part_name(pieces[1] + parts.HEADER_SUFFIX) is None \
                or not 0 < head_bytes <= min(total - peer_auth.TAG_BYTES, MAX_HEADER):
            self._refuse(400)
            return
        tag = self.server.key.body_tag(nonce, peer_auth.put_what(self.path))
        head = self.rfile.read(head_bytes)
        tag.update(head)
        try:
            self.server.keeper.receive(pieces[1], head, self.rfile, total - head_bytes - peer_auth.TAG_BYTES, tag)
        except Conflict as exc:
            self._refuse(409, str(exc))
            return
        except (ValueError, CorruptCheckpoint) as exc:
            self._refuse(400, str(exc))
            return
        except OSError as exc:
            self._refuse(507, str(exc))
            return
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
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
