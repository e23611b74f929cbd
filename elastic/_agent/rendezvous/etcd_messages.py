"""etcd's v3 requests and replies in the JSON API's shape, to and from the gRPC messages.

Callers build requests and read replies as etcd's JSON gateway took and gave
them (`{"request_put": {"key": <base64>, ...}}`, replies with
`header.revision`, `succeeded`, `responses`); this module converts them to
and from the messages `etcd-sdk-python` (import `pyetcd`) generates, and
decodes replies (`key_values`, `txn_revision`, `txn_range_results`).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from pyetcd import etcdrpc

CURRENT_LEASE = object()
"""Marks a put's lease in a request built before sending: the client's lease of that moment."""


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it. Revisions are etcd's: 0 means 'never'."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch: `kv` as written, or as deleted (then its value is
    empty and its `mod_revision` is the deletion's revision)."""

    deleted: bool
    kv: KeyValue


def encode(data: bytes) -> str:
    """Bytes as etcd's JSON API writes them (base64)."""
    return base64.b64encode(data).decode()


def decode(text: str) -> bytes:
    return base64.b64decode(text)


_RESULTS = etcdrpc.Compare.CompareResult
_TARGETS = etcdrpc.Compare.CompareTarget
_COMPARE_VALUES = {"version": int, "create_revision": int, "mod_revision": int, "lease": int, "value": decode}


def compare_message(spec: dict[str, Any]) -> etcdrpc.Compare:
    """`{"key", "result", "target", <target field>}` (JSON API) -> a Compare message."""
    compare = etcdrpc.Compare(
        key=decode(spec["key"]),
        result=_RESULTS.Value(spec.get("result", "EQUAL")),
        target=_TARGETS.Value(spec.get("target", "VERSION")),
    )
    if "range_end" in spec:
        compare.range_end = decode(spec["range_end"])
    for name, convert in _COMPARE_VALUES.items():
        if name in spec:
            setattr(compare, name, convert(spec[name]))
    return compare


def request_op(op: dict[str, Any], lease: int) -> etcdrpc.RequestOp:
    """A transaction operation (JSON API) -> a RequestOp message. Puts and reads of
    one key, what the rendezvous sends, go the quick way; anything else through
    protobuf's JSON parser."""
    put, read = op.get("request_put"), op.get("request_range")
    if put is not None and put.keys() <= {"key", "value", "lease"}:
        chosen = lease if put.get("lease") is CURRENT_LEASE else int(put.get("lease", 0))
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
            key=decode(put["key"]), value=decode(put.get("value", "")), lease=chosen))
    if read is not None and read.keys() <= {"key", "range_end", "revision"}:
        return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
            key=decode(read["key"]), range_end=decode(read.get("range_end", "")), revision=int(read.get("revision", 0))))
    if put is not None and put.get("lease") is CURRENT_LEASE:
        op = {**op, "request_put": {**put, "lease": lease}}
    return json_format.ParseDict(op, etcdrpc.RequestOp())


def _kv_json(kv: Any) -> dict[str, Any]:
    return {"key": encode(kv.key), "value": encode(kv.value), "create_revision": kv.create_revision,
            "mod_revision": kv.mod_revision, "version": kv.version, "lease": kv.lease}


def range_json(reply: etcdrpc.RangeResponse) -> dict[str, Any]:
    return {"header": {"revision": reply.header.revision}, "kvs": [_kv_json(kv) for kv in reply.kvs],
            "count": reply.count, "more": reply.more}


def txn_json(reply: etcdrpc.TxnResponse) -> dict[str, Any]:
    """A TxnResponse in the JSON API's shape (revisions as ints, keys and values base64)."""
    responses: list[dict[str, Any]] = []
    for response in reply.responses:
        kind = response.WhichOneof("response")
        if kind == "response_range":
            responses.append({kind: range_json(response.response_range)})
        elif kind == "response_txn":
            responses.append({kind: txn_json(response.response_txn)})
        else:
            responses.append({kind: json_format.MessageToDict(getattr(response, kind), preserving_proto_field_name=True)})
    return {"header": {"revision": reply.header.revision}, "succeeded": reply.succeeded, "responses": responses}


def key_value(kv: Any) -> KeyValue:
    return KeyValue(key=kv.key, value=kv.value, create_revision=kv.create_revision, mod_revision=kv.mod_revision)


def prefix_end(key: bytes) -> bytes:
    """The smallest key greater than every key that starts with `key` (etcd's range_end)."""
    stripped = key.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def key_values(range_reply: dict[str, Any]) -> list[KeyValue]:
    """The keys of a range reply, decoded (zero fields may be absent, as from the gateway)."""
    return [
        KeyValue(
            key=decode(kv["key"]),
            value=decode(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
        )
        for kv in range_reply.get("kvs", [])
    ]


def txn_revision(reply: dict[str, Any]) -> int:
    """The store revision a transaction produced (the mod revision of what it put)."""
    return int(reply["header"]["revision"])


def txn_range_results(reply: dict[str, Any]) -> Sequence[list[KeyValue]]:
    """The keys returned by each range request of a transaction's taken branch."""
    return [key_values(r["response_range"]) for r in reply.get("responses", []) if "response_range" in r]
