"""A worker's requests to snapshot keepers: copy a part to a peer node's keeper, read a range of one.

Both sides of the protocol are in keeper_endpoint.py (the keeper's) and
storage/peer_auth.py (the signatures and tags).

Invariants:
- Every request is signed with the job's secret, and every body carries its tag.
- A range is returned only once the keeper's tag over it, bound to this
  request's nonce, status and range, verified: bytes a forger or a stale
  answer sends are an `OSError`, never data.
"""

from __future__ import annotations

import http.client
from urllib.parse import SplitResult, urlsplit

from elastic.storage import peer_auth
from elastic.storage.keeper_address import HEADER_BYTES, replica_path
from elastic.storage.peer_auth import NONCE, TAG_BYTES, PeerKey

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
    signed = key.sign("PUT", path, content_length=length, header_bytes=len(head))
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
    """Bytes [start, stop) of the part at `part_url` (fewer if it is shorter), by a signed range request,
    returned only once their tag verified; `OSError` for any other answer."""
    url = urlsplit(part_url)
    conn = _connection(url, timeout)
    try:
        signed = key.sign("GET", url.path)
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
        return data
    finally:
        conn.close()


def _content_range(text: str) -> tuple[int, int, int] | None:
    """(first, last + 1, size) of a `bytes first-last/size` Content-Range; None for anything else."""
    unit, _, rest = text.strip().partition(" ")
    span, _, size = rest.partition("/")
    first, _, last = span.partition("-")
    if unit != "bytes" or not all(x.isascii() and x.isdigit() for x in (first, last, size)):
        return None
    return int(first), int(last) + 1, int(size)
