"""A worker's requests to snapshot keepers: copy a part to a peer node's keeper, read a range of one.

Both sides of the protocol are in keeper_endpoint.py (the keeper's) and
storage/peer_auth.py (the signatures and tags).

Invariants:
- Every request is signed with the job's secret for the keeper it is sent to (the
  `host:port` of its URL), and every body carries its tag.
- A range is returned only once the keeper's tag over it, bound to this
  request's nonce, status and range, verified: bytes a forger or a stale
  answer sends are an `OSError`, never data.
"""

from __future__ import annotations

import http.client
import threading
from urllib.parse import SplitResult, urlsplit

from elastic._shared.storage import peer_auth
from elastic._shared.storage.keeper_address import HEADER_BYTES, replica_path
from elastic._shared.storage.peer_auth import NONCE, TAG_BYTES, PeerKey

_tls = None


def _connection(url: SplitResult, timeout: float) -> http.client.HTTPConnection:
    global _tls
    if url.scheme == "https":
        if _tls is None:
            _tls = peer_auth.client_tls()
        return http.client.HTTPSConnection(url.hostname, url.port, timeout=timeout, context=_tls)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)


def push_part(keeper_url: str, key: PeerKey, stem: str, head: bytes, data: memoryview, timeout: float) -> None:
    """PUT a part (its JSON header `head`, then `data`) to the keeper at `keeper_url`; `OSError` or
    `http.client.HTTPException` unless it answered 204."""
    url = urlsplit(keeper_url)
    path = replica_path(stem)
    length = len(head) + len(data) + TAG_BYTES
    signed = key.sign("PUT", path, receiver=url.netloc, content_length=length, header_bytes=len(head))
    tag = key.body_tag(signed[NONCE], peer_auth.put_what(path))
    tag.update(head)
    tag.update(data)
    conn = _connection(url, timeout)
    try:
        conn.putrequest("PUT", path)
        conn.putheader("Content-Length", str(length))
        conn.putheader(HEADER_BYTES, str(len(head)))
        for name, value in signed.items():
            conn.putheader(name, value)
        conn.endheaders()
        conn.send(head)
        conn.send(data)
        conn.send(tag.finalize())
        response = conn.getresponse()
        response.read()
        if response.status != 204:
            raise OSError(f"HTTP {response.status} {response.reason}")
    finally:
        conn.close()


def get_range(part_url: str, key: PeerKey, start: int, stop: int, timeout: float) -> bytearray:
    """Bytes [start, stop) of the part at `part_url` (fewer if it is shorter), by a signed range request
    on a connection of its own, returned only once their tag verified; `OSError` for any other answer.
    `KeeperConnections.get_range` does the same on kept connections."""
    url = urlsplit(part_url)
    conn = _connection(url, timeout)
    try:
        return _range_on(conn, url, key, start, stop)[0]
    finally:
        conn.close()


# A kept connection the keeper closed while it was idle (its header deadline, a restart) fails
# the next request before any answer: that request is sent once more, on a fresh connection.
_STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)
MAX_IDLE_PER_KEEPER = 4


class KeeperConnections:
    """Connections to keepers kept open between range requests (HTTP/1.1 keep-alive), so that
    a restore of many ranges opens about one per keeper instead of one per range. Thread-safe:
    a request takes an idle connection to its keeper or opens one, and gives it back after a
    complete answer (at most `MAX_IDLE_PER_KEEPER` idle per keeper; any failure closes it).

    Invariant: as `get_range`, every range is signed with a fresh nonce and returned only once
    its tag verified; reuse changes where the bytes travel, not what is trusted."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self.opened = 0
        """Connections opened so far (the benchmark and the tests count them)."""

    def get_range(self, part_url: str, key: PeerKey, start: int, stop: int, timeout: float) -> bytearray:
        url = urlsplit(part_url)
        where = (url.scheme, url.hostname or "", url.port or 0)
        kept = self._take(where)
        if kept is not None:
            try:
                return self._send(kept, where, url, key, start, stop, timeout)
            except _STALE:
                pass
        with self._lock:
            self.opened += 1
        return self._send(_connection(url, timeout), where, url, key, start, stop, timeout)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for conn in connections:
                conn.close()

    def _take(self, where: tuple[str, str, int]) -> http.client.HTTPConnection | None:
        with self._lock:
            connections = self._idle.get(where)
            return connections.pop() if connections else None

    def _send(self, conn: http.client.HTTPConnection, where: tuple[str, str, int], url: SplitResult, key: PeerKey,
              start: int, stop: int, timeout: float) -> bytearray:
        reusable = False
        try:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            data, reusable = _range_on(conn, url, key, start, stop)
            return data
        finally:
            with self._lock:
                idle = self._idle.setdefault(where, [])
                if reusable and len(idle) < MAX_IDLE_PER_KEEPER:
                    idle.append(conn)
                    conn = None  # type: ignore[assignment]
            if conn is not None:
                conn.close()


def _range_on(conn: http.client.HTTPConnection, url: SplitResult, key: PeerKey, start: int,
              stop: int) -> tuple[bytearray, bool]:
    """One signed range request on `conn`: (the verified bytes, whether `conn` may carry another)."""
    signed = key.sign("GET", url.path, receiver=url.netloc)  # only the keeper it is sent to accepts it
    conn.request("GET", url.path, headers={"Range": f"bytes={start}-{stop - 1}", **signed})
    response = conn.getresponse()
    if response.status != 206:  # a 416 (past the end) too: it carries no tag, so the next keeper is asked
        response.read()
        raise OSError(f"HTTP {response.status} {response.reason} for {url.path}")
    declared = (response.headers.get("Content-Length") or "").strip()
    length = int(declared) - TAG_BYTES if declared.isascii() and declared.isdigit() else -1
    got_range = _content_range(response.headers.get("Content-Range") or "")
    if not 0 <= length <= stop - start or got_range is None or got_range[:2] != (start, start + length):
        raise OSError(f"{url.path}: a malformed answer ({declared or 'no'} bytes for a range of {stop - start})")
    data = bytearray(length + TAG_BYTES)
    view, got = memoryview(data), 0
    while got < len(data):
        n = response.readinto(view[got:])
        if not n:
            raise OSError(f"{url.path} ended after {got} of {len(data)} bytes")
        got += n
    tag = key.body_tag(signed[NONCE], peer_auth.response_what(url.path, 206, start, start + length, got_range[2]))
    tag.update(view[:length])
    if not peer_auth.check_tag(tag, bytes(view[length:])):
        raise OSError(f"{url.path}: the keeper's answer fails its tag")
    del view
    del data[length:]
    return data, not response.will_close


def _content_range(text: str) -> tuple[int, int, int] | None:
    """(first, last + 1, size) of a `bytes first-last/size` Content-Range; None for anything else."""
    unit, _, rest = text.strip().partition(" ")
    span, _, size = rest.partition("/")
    first, _, last = span.partition("-")
    if unit != "bytes" or not all(x.isascii() and x.isdigit() for x in (first, last, size)):
        return None
    return int(first), int(last) + 1, int(size)
