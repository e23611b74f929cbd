"""Where a worker's heals meet: its round's namespace of the rendezvous store, sealed as the agents seal it.

The agents hand torch's agent a `SealedStore` over the rendezvous store (elastic._agent.rendezvous.handlers),
in the scope of their launch: every value in it, counters included, is sealed with the job's secret and
bound to the run, the launch and the key. A worker reaches the same store directly (`heal_env.HEAL_STORE_ENV`)
and must seal and check exactly as they do: the launch comes from its agent (round_identity).

Invariant: with a secret, a worker never reads the rendezvous store unsealed; without its launch it does
not heal at all (`EnvironmentConfigError`, one line), rather than read values it cannot check.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic._shared.common.errors import EnvironmentConfigError
from elastic._shared.protocol import heal_env, round_identity
from elastic._shared.storage.peer_auth import PeerKey
from elastic._shared.storage.sealed_store import SealedStore


def heal_store(
    environ: Mapping[str, str], host: str, port: int, namespace: str, key: PeerKey | None, timeout: timedelta
) -> dist.PrefixStore:
    """A client of the rendezvous store at `host`:`port`, sealed, in the heals' `namespace`; RuntimeError
    when it cannot be reached."""
    identity = round_identity.read(environ)
    if key is not None and identity is None:
        raise EnvironmentConfigError(f"{round_identity.ROUND_ENV} is not set: the agent did not say which launch "
                                     "this worker is in, whose seal the rendezvous store's values carry")
    scope = "" if identity is None else round_identity.rendezvous_scope(
        environ.get("TORCHELASTIC_RUN_ID") or "none", identity.launch)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(heal_env.namespace_prefix(namespace), SealedStore(store, key, scope))
