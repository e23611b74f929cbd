"""torch's pickled rendezvous state, read without running anything it names.

torch's dynamic rendezvous (behind `c10d` and `etcd-v3`) keeps its state as a
pickle of `_RendezvousState` in the rendezvous store, and `pickle.loads` it on
every read: a pickle can call any importable function, so whoever writes the
store could run code in every agent. `check_state` reads the bytes first with
an unpickler that can build only what torch's state holds, then checks every
field; torch is handed only bytes that passed (`elastic._agent.rendezvous.state_guard`).

Invariants:
- `find_class` resolves exactly `ALLOWED`: torch's `_RendezvousState` and
  `_NodeDesc`, and `datetime`'s `datetime`, `timezone` and `timedelta` (an
  aware `datetime` pickles as the three). Anything else is refused before it
  is imported or called; sets, frozensets, dicts, tuples, strings and numbers
  need no class.
- Bytes that pass load to a `_RendezvousState` whose every field has torch's
  type and range (and the two attributes quick rounds add, `quick_rounds.LAST_ROUND`
  and `DEPARTED`); no other attribute. Since `find_class` returns the same
  classes torch's `pickle.loads` would, torch's load of the same bytes builds
  the same object.
- At most `MAX_STATE_BYTES` are read; every refusal is `StateRefused`, one line.
"""

from __future__ import annotations

import io
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _NodeDesc,
    _RendezvousState,
)

from elastic._agent.rendezvous.quick_rounds import DEPARTED, LAST_ROUND

MAX_STATE_BYTES = 4 << 20
"""A state of thousands of nodes is a few hundred KiB."""
ALLOWED = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"): _RendezvousState,
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"): _NodeDesc,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
}
MAX_ADDRESS = 1024
"""Characters of a node's address (an FQDN is at most 253; `--local-addr` is the user's)."""
_FIELDS = ("round", "complete", "deadline", "closed", "participants", "wait_list", "redundancy_list", "last_heartbeats")


class StateRefused(ValueError):
    """Bytes that are not a rendezvous state this agent may hand torch (one line, why)."""


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise StateRefused(f"it names {module[:80]}.{name[:80]}, which a rendezvous state never holds") from None


def check_state(payload: bytes) -> _RendezvousState:
    """The state `payload` pickles, loaded by the restricted unpickler and checked field by field;
    `StateRefused` otherwise (nothing outside `ALLOWED` is ever imported or called)."""
    if len(payload) > MAX_STATE_BYTES:
        raise StateRefused(f"it is {len(payload)} bytes, over {MAX_STATE_BYTES}")
    try:
        state = _StateUnpickler(io.BytesIO(payload)).load()
    except StateRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed pickle is one refusal, never a traceback
        raise StateRefused(f"it is not a pickle torch could read ({type(exc).__name__})") from None
    if type(state) is not _RendezvousState:
        raise StateRefused(f"it holds a {type(state).__name__}, not torch's rendezvous state")
    _check_fields(vars(state))
    return state


def _check_fields(fields: dict[str, Any]) -> None:
    extra = set(fields) - set(_FIELDS) - {LAST_ROUND, DEPARTED}
    if extra or not set(_FIELDS) <= set(fields):
        raise StateRefused("its fields are not those of torch's rendezvous state")
    if not (_is_int(fields["round"]) and type(fields["complete"]) is bool and type(fields["closed"]) is bool):
        raise StateRefused("its round, complete or closed field has the wrong type")
    if fields["deadline"] is not None and not _is_aware(fields["deadline"]):
        raise StateRefused("its deadline is not a time with a zone")
    participants = fields["participants"]
    if type(participants) is not dict or not all(_is_node(n) and _is_int(r) for n, r in participants.items()):
        raise StateRefused("its participants are not nodes with ranks")
    for name in ("wait_list", "redundancy_list"):
        if type(fields[name]) is not set or not all(map(_is_node, fields[name])):
            raise StateRefused(f"its {name} is not a set of nodes")
    beats = fields["last_heartbeats"]
    if type(beats) is not dict or not all(_is_node(n) and _is_aware(t) for n, t in beats.items()):
        raise StateRefused("its heartbeats are not nodes with times")
    last = fields.get(LAST_ROUND)
    if last is not None and not (type(last) is tuple and len(last) == 2 and _is_int(last[0]) and _is_nodes(last[1])):
        raise StateRefused("its last round is not a round number and a set of nodes")
    if DEPARTED in fields and not _is_nodes(fields[DEPARTED]):
        raise StateRefused("its departed nodes are not a set of nodes")


def _is_int(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 62


def _is_aware(value: Any) -> bool:
    return type(value) is datetime and value.utcoffset() is not None


def _is_node(node: Any) -> bool:
    if type(node) is not _NodeDesc or set(vars(node)) != {"addr", "pid", "local_id"}:
        return False
    return type(node.addr) is str and 0 < len(node.addr) <= MAX_ADDRESS and _is_int(node.pid) and _is_int(node.local_id)


def _is_nodes(nodes: Any) -> bool:
    return type(nodes) is frozenset and all(map(_is_node, nodes))
