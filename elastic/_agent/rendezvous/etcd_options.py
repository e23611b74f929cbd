"""What `--rdzv-endpoint`, `--rdzv-id` and `--rdzv-conf` say about etcd, read and checked.

The options are documented, as a table, in `elastic._agent.rendezvous.etcd`. Bad
values are one `EtcdOptionsError` line each (a `ValueError`), raised before
anything connects; torchrun's entry point turns it into that line and exit 2.

Invariants:
- no secret comes from `--rdzv-conf`: torchrun logs its options at INFO and they
  show in `ps`, so `password=` is refused (`password_file=` names a file);
- no credential travels in clear text: `user`/`password_file` need https;
- one run's keys never fall in another run's ranges: a key prefix is split at
  '/', and no part of it may be a name the layout puts right after a prefix
  (`rdzv`, `store`, `store.ops`, `agents`, `alive`); a run id is one such part, of
  `[A-Za-z0-9._-]`. Two prefixes whose keys met would then agree part by part
  up to the layout's name, which is the shorter prefix's end: they are equal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic._agent.timings import DEFAULT_READ_TIMEOUT, DEFAULT_TTL

T = TypeVar("T")

DEFAULT_PORT = 2379
# The names a run's layout puts right after its key prefix (see `elastic._agent.rendezvous.etcd`).
LAYOUT_NAMES = frozenset({"rdzv", "store", "store.ops", "agents", "alive"})
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class EtcdOptionsError(ValueError):
    """A bad `--rdzv-endpoint`, `--rdzv-id` or `--rdzv-conf` value: one line, what to do."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """`h1:2379,h2,[::1]:2380` -> endpoints, port 2379 where none is given."""
    endpoints = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        scheme, sep, rest = part.partition("://")
        if sep:  # http://h:2379 is what etcd's own flags look like: accept it
            if scheme not in ("http", "https"):
                raise EtcdOptionsError(f"etcd endpoint {part!r}: only http:// or https:// (or no scheme)")
            part = rest.rstrip("/")
        if part.startswith("["):
            host, _, rest = part[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif part.count(":") == 1:
            host, port_text = part.split(":")
        else:
            host, port_text = part, ""
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise EtcdOptionsError(f"etcd endpoint {part!r} has a port that is not a number") from None
        if not host or not 0 < port < 65536:
            raise EtcdOptionsError(f"etcd endpoint {part!r} is not HOST:PORT")
        endpoints.append(Endpoint(host, port))
    if not endpoints:
        raise EtcdOptionsError("the etcd-v3 rendezvous needs --rdzv-endpoint=HOST:PORT[,HOST:PORT...]")
    return tuple(endpoints)


@dataclass(frozen=True)
class EtcdOptions:
    """What `--rdzv-endpoint`, `--rdzv-id` and `--rdzv-conf` say about etcd.

    The options are documented, as a table, in `elastic._agent.rendezvous.etcd`.
    """

    endpoints: tuple[Endpoint, ...]
    key_prefix: str
    ttl: int
    read_timeout: float
    protocol: str = "http"
    ca_cert: str | None = None
    ssl_cert: str | None = None
    ssl_cert_key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> EtcdOptions:
        """Read and check the options; bad values raise EtcdOptionsError with one clear line."""
        if params.get("password") is not None:
            raise EtcdOptionsError(
                "rdzv-conf password=... would be in torchrun's log and in `ps`: "
                "write the password to a file readable only by you and give password_file=PATH instead"
            )
        prefix = key_prefix(params.run_id, params.get("key_prefix"))
        ttl = _positive(params, "ttl", DEFAULT_TTL, int)
        read_timeout = _positive(params, "read_timeout", DEFAULT_READ_TIMEOUT, float)
        protocol = (params.get("protocol") or "http").strip().lower()
        if protocol not in ("http", "https"):
            raise EtcdOptionsError(f"rdzv-conf protocol must be http or https, not {protocol!r}")
        files = {name: params.get(name) for name in ("ca_cert", "ssl_cert", "ssl_cert_key", "password_file")}
        for name, path in files.items():
            if path and not Path(path).is_file():
                raise EtcdOptionsError(f"rdzv-conf {name}: no such file {path}")
        if bool(files["ssl_cert"]) != bool(files["ssl_cert_key"]):
            raise EtcdOptionsError("rdzv-conf ssl_cert and ssl_cert_key go together: give both or neither")
        if (files["ca_cert"] or files["ssl_cert"]) and protocol != "https":
            raise EtcdOptionsError("rdzv-conf ca_cert/ssl_cert need protocol=https")
        user = params.get("user") or None
        if (user or files["password_file"]) and protocol != "https":
            raise EtcdOptionsError(
                "rdzv-conf user/password_file over protocol=http would send the password in clear text: "
                "serve etcd on https and add protocol=https,ca_cert=CA.pem"
            )
        password = None
        if files["password_file"]:
            lines = Path(files["password_file"]).read_text().splitlines()
            password = lines[0] if lines else ""
        if password is not None and not user:
            raise EtcdOptionsError("rdzv-conf password_file needs user")
        if user and password is None:
            raise EtcdOptionsError("rdzv-conf user needs password_file")
        endpoints = parse_endpoints(params.endpoint)
        schemes = {p.strip().partition("://")[0] for p in params.endpoint.split(",") if "://" in p}
        if schemes - {protocol}:
            raise EtcdOptionsError(
                f"--rdzv-endpoint says {'/'.join(sorted(schemes))}:// but the protocol is {protocol}: "
                f"add protocol={'/'.join(sorted(schemes))} to --rdzv-conf"
            )
        return cls(
            endpoints=endpoints,
            key_prefix=prefix,
            ttl=ttl,
            read_timeout=read_timeout,
            protocol=protocol,
            ca_cert=files["ca_cert"],
            ssl_cert=files["ssl_cert"],
            ssl_cert_key=files["ssl_cert_key"],
            user=user,
            password=password,
        )


def key_prefix(run_id: str, given: str | None = None) -> str:
    """Where a run's keys live: `given` (rdzv-conf key_prefix) or `/torchrevive/<run_id>`,
    checked so that no two runs' keys meet (see the module docstring)."""
    if not run_id:
        raise EtcdOptionsError("the etcd-v3 rendezvous needs a non-empty --rdzv-id")
    if not _RUN_ID.fullmatch(run_id) or run_id in LAYOUT_NAMES:
        raise EtcdOptionsError(
            f"--rdzv-id {run_id[:140]!r}: use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit, and none of {', '.join(sorted(LAYOUT_NAMES))} (a run's keys live under /torchrevive/<id>/)"
        )
    prefix = (given or f"/torchrevive/{run_id}").rstrip("/")
    if not prefix:
        raise EtcdOptionsError("rdzv-conf key_prefix must not be empty")
    taken = sorted(set(prefix.split("/")) & LAYOUT_NAMES)
    if taken:
        raise EtcdOptionsError(
            f"rdzv-conf key_prefix {prefix!r} has a part named {taken[0]!r}, which names a part of a run's keys "
            "(another run's keys could be under it): rename that part"
        )
    return prefix


def _positive(params: RendezvousParameters, name: str, default: T, kind: Callable[[str], T]) -> T:
    text = params.get(name)
    if text is None or text == "":
        return default
    what = "a positive integer" if kind is int else "a positive, finite number"
    try:
        value = kind(str(text))
    except ValueError:
        raise EtcdOptionsError(f"rdzv-conf {name} must be {what}, not {text!r}") from None
    if not 0 < value < math.inf:  # type: ignore[operator]  # also rejects nan
        raise EtcdOptionsError(f"rdzv-conf {name} must be {what}, not {text!r}")
    return value
