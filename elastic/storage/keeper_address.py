"""Where a node's snapshot keeper keeps snapshot parts, and how workers and peers reach them.

The keeper (elastic.launcher.keeper, in the agent) and the workers
(elastic.checkpoint.memory) never import each other; this is what they share:

- the environment the keeper gives its workers (`KeeperAddress.environ`);
- the layout of its directory in node memory:

      <root>/local/      parts this node's workers wrote (parts.py names them)
      <root>/replica/    parts a peer node's workers copied here
      <root>/progress/   rank_NNNNN: the newest step each worker finished (8 bytes)

- the routes of its HTTP endpoint: `GET /part/<local|replica>/<part file>` (whole,
  or one `Range: bytes=a-b`) and `PUT /replica/<part stem>` (header, then data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT_ENV = "TORCHREVIVE_SNAPSHOT_ROOT"
URL_ENV = "TORCHREVIVE_SNAPSHOT_URL"
NODE_ENV = "TORCHREVIVE_SNAPSHOT_NODE"
LOCAL, REPLICA, PROGRESS = "local", "replica", "progress"
HEADER_BYTES = "X-Header-Bytes"
"""PUT: how many bytes of the body are the part's JSON header (the data follows)."""


@dataclass(frozen=True)
class KeeperAddress:
    """Where this node's keeper keeps snapshots (`root`) and serves them to peers (`url`)."""

    root: Path
    url: str
    node: str

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> KeeperAddress | None:
        env = os.environ if environ is None else environ
        root, url, node = env.get(ROOT_ENV), env.get(URL_ENV), env.get(NODE_ENV)
        if not (root and url and node) or not os.path.isdir(root):
            return None
        return cls(Path(root), url, node)

    def environ(self) -> dict[str, str]:
        return {ROOT_ENV: str(self.root), URL_ENV: self.url, NODE_ENV: self.node}


def part_url(keeper_url: str, where: str, file_name: str) -> str:
    """The URL of a part file a keeper holds (`where`: LOCAL or REPLICA)."""
    return f"{keeper_url}/part/{where}/{file_name}"


def replica_path(stem: str) -> str:
    """The path a peer PUTs a part to."""
    return f"/{REPLICA}/{stem}"
