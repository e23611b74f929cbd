"""torchrun rendezvous plugins. `etcd` holds the `etcd-v3` backend (see its docstring:
its options, its keys, and how a job relaunched with the same id reopens a closed run).
`state_guard` stands between torch and every store's rendezvous state (`state_seal`,
`state_pickle`); `guarded_c10d` gives torchrevive-run its guarded handlers.

This package's own module stays free of torch imports: torch loads the entry point
below while it imports its rendezvous registry, which may happen in the middle of
importing `elastic._agent.rendezvous.etcd` itself, so the backend is imported only when
torchrun asks for a handler.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )


def etcd_v3_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point `etcd-v3`: torch calls it with no arguments
    and registers the handler creator it returns."""
    return _create_etcd_v3_handler


def _create_etcd_v3_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's handler on etcd v3; a bad option ends torchrun with one line and exit 2
    (a traceback would bury it, and torchrun would show it once per agent)."""
    from elastic._agent.rendezvous.etcd import create_handler_v3
    from elastic._agent.rendezvous.etcd_options import EtcdOptionsError
    from elastic._shared.storage.peer_auth import SecretError

    try:
        return create_handler_v3(params)
    except (EtcdOptionsError, SecretError) as exc:  # SecretError: the job's secret, named, cannot be read
        print(f"torchrun: error: --rdzv-backend=etcd-v3: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
