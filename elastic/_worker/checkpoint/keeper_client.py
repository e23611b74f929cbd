"""A worker's requests to snapshot keepers: copy a part to a peer node's keeper, read a range of one.

Both sides of the protocol are in keeper_endpoint.py (the keeper's) and
storage/peer_auth.py (the signatures and tags).

Invariants:
- Every request is signed with the job's secret for the keeper it is sent to (the
  `host:port` of its URL), and every body carries its tag.
- A range is returned only once the keeper's tag over it, bound to this
  request's nonce, status and range, verified: bytes a forger or a stale
  answer sends are an `OSError`, never data.
- A request's `timeout` bounds the whole of it, not each read: at its end a
  watchdog shuts the connection (`_Watchdog`), so a peer that trickles its
  answer a byte at a time, or stalls in the TLS handshake or the headers, is
  an `OSError` then, never a wait without end.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from urllib.parse import SplitResult, urlsplit

from elastic._shared.storage import peer_auth
from elastic._shared.storage.keeper_address import HEADER_BYTES, replica_path
from elastic._shared.storage.peer_auth import NONCE, TAG_BYTES, PeerKey

_tls: ssl.SSLContext | None = None


def use_tls_of(environ: Mapping[str, str]) -> None:
    """How keepers' certificates are checked from now on (`peer_auth.client_tls`: the job's CA when the
    worker's environment names one); the checkpoint manager calls it with the worker's parsed environment."""
    global _tls
    _tls = peer_auth.client_tls(environ)


def _connection(url: SplitResult, timeout: float) -> http.client.HTTPConnection:
    global _tls
    if url.scheme == "https":
        if _tls is None:  # not told of a CA: the system's (a keeper's self-signed certificate is refused)
            _tls = peer_auth.client_tls({})
        return http.client.HTTPSConnection(url.hostname, url.port, timeout=timeout, context=_tls)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)


class _Watchdog:
    """Shuts `conn`'s socket `seconds` from now unless `stop`ped first: the overall deadline of one
    request, which per-read socket timeouts cannot give (each trickled byte restarts them)."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self.fired = False
        self._stopped = False
        self._timer = threading.Timer(max(0.0, seconds), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.fired = True
            sock = self._conn.sock  # the raw socket during a TLS handshake, so that ends too
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> bool:
        """Stop it; whether it had fired (the connection is then unusable)."""
        self._timer.cancel()
        with self._lock:
            self._stopped = True
            return self.fired


def _overall(watchdog: _Watchdog, seconds: float, exc: BaseException) -> BaseException:
    """`exc` as a request's error: a `TimeoutError` naming the overall deadline when the watchdog fired."""
    if watchdog.stop():
        return TimeoutError(f"no complete answer within the request's {seconds:g} s")
    return exc


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
    watchdog = _Watchdog(conn, timeout)
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
    except (OSError, http.client.HTTPException) as exc:
        raise _overall(watchdog, timeout, exc) from None
    finally:
        watchdog.stop()
        conn.close()


def get_range(part_url: str, key: PeerKey, start: int, stop: int, timeout: float) -> bytearray:
    """Bytes [start, stop) of the part at `part_url` (fewer if it is shorter), by a signed range request
    on a connection of its own, returned only once their tag verified; `OSError` for any other answer.
    `KeeperConnections.get_range` does the same on kept connections."""
    url = urlsplit(part_url)
    conn = _connection(url, timeout)
    watchdog = _Watchdog(conn, timeout)
    try:
        return _range_on(conn, url, key, start, stop)[0]
    except (OSError, http.client.HTTPException) as exc:
        raise _overall(watchdog, timeout, exc) from None
    finally:
        watchdog.stop()
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
        deadline = time.monotonic() + timeout  # for both tries together
        kept = self._take(where)
        if kept is not None:
            try:
                return self._send(kept, where, url, key, start, stop, timeout)
            except _STALE:
                pass
        with self._lock:
            self.opened += 1
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete answer within the request's {timeout:g} s")
        return self._send(_connection(url, left), where, url, key, start, stop, left)

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
        watchdog = _Watchdog(conn, timeout)
        try:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            data, reusable = _range_on(conn, url, key, start, stop)
            return data
        except _STALE as exc:
            if watchdog.stop():
                raise TimeoutError(f"no complete answer within the request's {timeout:g} s") from None
            raise exc from None  # a kept connection the keeper closed: the caller tries a fresh one
        except (OSError, http.client.HTTPException) as exc:
            raise _overall(watchdog, timeout, exc) from None
        finally:
            reusable = not watchdog.stop() and reusable
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
