"""The rendezvous settings that make recoveries fast, shared by the launcher and the workers' hint.

`torchrevive-run` applies them (elastic._agent.launcher.launch); a worker under plain
torchrun that lacks them says, in one line, how to get them
(elastic._worker.runtime.round_store.recovery_hint). docs/recovery.md explains each trade-off.
"""

from __future__ import annotations

RECOVERY_RDZV_CONF = {
    "last_call_timeout": "2",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
}
"""torch's defaults: a 30 s last call in every round with MIN < MAX nodes, and a dead node
declared dead after 15 s; these: 2 s and about 3 s."""
FRESH_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1: a fresh worker store per rendezvous round (torch's shared one times out a node
that joins after the first round)."""


def merged_rdzv_conf(user_conf: str) -> str:
    """`user_conf` (torchrun's `k=v,k=v`) with our defaults for the keys it lacks."""
    given = [item for item in (user_conf or "").split(",") if item.strip()]
    keys = {item.split("=", 1)[0].strip() for item in given}
    extra = [f"{k}={v}" for k, v in RECOVERY_RDZV_CONF.items() if k not in keys]
    return ",".join(given + extra)
