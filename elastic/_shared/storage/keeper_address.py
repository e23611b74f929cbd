"""Where a node's snapshot keeper keeps snapshot parts, and how workers and peers reach them.

The keeper (elastic._agent.launcher.keeper, in the agent) and the workers
(elastic._worker.checkpoint.memory) never import each other; this is what they share:

- the environment the keeper gives its workers (`KeeperAddress.environ`);
- the layout of its directory in node memory:

      <root>/local/      parts this node's workers wrote (parts.py names them)
      <root>/replica/    parts a peer node's workers copied here
      <root>/progress/   rank_NNNNN: the newest step each worker finished (8 bytes)
      <root>/job.json    the run, generation and world size its workers run now (local
                         rank 0 writes it at each restore; the keeper keeps replicas of it only)

- the routes of its HTTP endpoint: `GET /part/<local|replica>/<part file>` (whole,
  or one `Range: bytes=a-b`) and `PUT /replica/<part stem>` (header, then data),
  every request signed and every body tagged (peer_auth.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from elastic._shared.storage.durable import replace_small
from elastic._shared.storage.peer_auth import SECRET_FILE_ENV

# Internal plumbing, not settings: the agent sets these for its workers (KeeperAddress.environ;
# elastic._agent.launcher.settings.INTERNAL lists every such variable).
ROOT_ENV = "TORCHREVIVE_SNAPSHOT_ROOT"
URL_ENV = "TORCHREVIVE_SNAPSHOT_URL"
NODE_ENV = "TORCHREVIVE_SNAPSHOT_NODE"
LOCAL, REPLICA, PROGRESS = "local", "replica", "progress"
JOB_FILE = "job.json"
HEADER_BYTES = "X-Header-Bytes"
"""PUT: how many bytes of the body are the part's JSON header (the data follows)."""


@dataclass(frozen=True)
class KeeperAddress:
    """Where this node's keeper keeps snapshots (`root`) and serves them to peers (`url`)."""

    root: Path
    url: str
    node: str
    secret_file: Path | None = None
    """The job's secret for signing keeper traffic (None: the environment holds it already)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KeeperAddress | None:
        env = environ
        root, url, node = env.get(ROOT_ENV), env.get(URL_ENV), env.get(NODE_ENV)
        if not (root and url and node) or not os.path.isdir(root):
            return None
        secret_file = env.get(SECRET_FILE_ENV)
        return cls(Path(root), url, node, Path(secret_file) if secret_file else None)

    def environ(self) -> dict[str, str]:
        env = {ROOT_ENV: str(self.root), URL_ENV: self.url, NODE_ENV: self.node}
        if self.secret_file is not None:
            env[SECRET_FILE_ENV] = str(self.secret_file)
        return env

    def note_job(self, run_id: str, generation: str, world_size: int) -> None:
        """Tell the keeper which replicas to accept from now on (see the module docstring)."""
        replace_small(self.root, JOB_FILE, json.dumps({"run_id": run_id, "generation": generation, "world_size": world_size}))


def part_url(keeper_url: str, where: str, file_name: str) -> str:
    """The URL of a part file a keeper holds (`where`: LOCAL or REPLICA)."""
    return f"{keeper_url}/part/{where}/{file_name}"


def replica_path(stem: str) -> str:
    """The path a peer PUTs a part to."""
    return f"/{REPLICA}/{stem}"
