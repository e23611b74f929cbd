"""Whether a process of another pid namespace on this kernel still lives: a name the kernel drops with it.

Containers side by side (`docker --ipc=host --network=host`) share /dev/shm and
a host name but not their pids: a pid recorded by one means nothing to the
other, and "no such pid here" says nothing about the process. What they do
share is the network namespace, and with it the abstract Unix socket names: a
process holds one (`own_token`) for as long as it lives, and the kernel frees
it when the process ends, however it ends.

Invariants:
- A token is judged (`token_alive`) only by an observer of the same network
  namespace (`net_namespace`) as its holder; anywhere else a free name proves
  nothing, and the caller falls back to the holder's heartbeat.
- A forked child does not keep its parent's token: the parent's death frees it.
- A token read from a file is used only if it is `TOKEN`-shaped (never a path).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import threading
import uuid

TOKEN = re.compile(r"^[0-9a-f]{32}$")
_PREFIX = "\0torchrevive-live-"
_lock = threading.Lock()
_held: socket.socket | None = None
_token = ""


def net_namespace() -> int:
    """The inode of this process's network namespace (0 where it cannot be read)."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def own_token() -> str:
    """This process's token, bound once and held until it ends ("" where no abstract socket can be had)."""
    global _held, _token
    with _lock:
        if _held is None:
            token = uuid.uuid4().hex
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(_PREFIX + token)
            except OSError:
                sock.close()
                return ""
            _held, _token = sock, token
        return _token


def token_alive(token: str) -> bool | None:
    """Whether the process holding `token` lives (in this network namespace): True when its name is
    taken, False when it is free, None when that cannot be told (a malformed token, no sockets)."""
    if not TOKEN.match(token):
        return None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.bind(_PREFIX + token)  # free: nobody holds it; our hold ends with the close below
    except OSError as exc:
        return True if exc.errno == errno.EADDRINUSE else None
    finally:
        probe.close()
    return False


def _forget_in_child() -> None:
    global _held, _token, _lock
    _lock = threading.Lock()
    if _held is not None:
        _held.close()  # the child's copy only: the parent keeps its name
    _held, _token = None, ""


os.register_at_fork(after_in_child=_forget_in_child)
