"""torchrun rendezvous plugins, made in one place (`handlers`): `c10d-sealed` (torch's c10d rendezvous,
its store listening on the endpoint's address: `c10d_store`) and `etcd-v3` (`etcd`: its options, its
keys, and how a job relaunched with the same id reopens a closed run). Every value their agents read
is authenticated: the state through `state_guard` (`state_seal`, `state_pickle`), the rest through
the sealed store (elastic._shared.storage.sealed_store).

This package's own module stays free of torch imports: torch loads the entry points below while it
imports its rendezvous registry, which may happen in the middle of importing one of this package's
modules, so the handlers are imported only when torchrun asks for one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )


def c10d_sealed_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point `c10d-sealed`: torch calls it with no arguments and registers
    the handler creator it returns."""
    from elastic._agent.rendezvous.handlers import create_c10d_sealed

    return create_c10d_sealed


def etcd_v3_handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point `etcd-v3`."""
    from elastic._agent.rendezvous.handlers import create_etcd_v3

    return create_etcd_v3
