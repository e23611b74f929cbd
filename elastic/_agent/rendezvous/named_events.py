"""torch's rendezvous events, named without `inspect.stack()`.

torch's dynamic rendezvous records an event for every action of a round, named after the method
that acted: its handler, its state holder and its executor each find that name with
`get_method_name`, which calls `inspect.stack()` twice (source lines of every frame of the stack),
whether or not any event handler is set to receive the event. In an agent with torch imported that
is 5 to 50 ms a call, most of a quick round's time. The three classes here are torch's, with their
`_record` reading the name from the caller's frame instead; the name and the event are torch's.
(The handler's own `_record` is `handlers.SealedHandler`'s.)
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
)


def method_name(depth: int = 2) -> str:
    """torch's `get_method_name`: the name of the function `depth` frames up from this one
    ("no_method_name" when the stack is not that deep), read from the frame itself."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


class NamedStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder; its events named by `method_name`."""

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        construct_and_record_rdzv_event(
            name=f"{self.__class__.__name__}.{method_name()}", run_id=self._settings.run_id, message=message,
            node_state=node_state,
        )


class NamedExecutor(_DistributedRendezvousOpExecutor):
    """torch's executor of rendezvous operations; its events named by `method_name`."""

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        construct_and_record_rdzv_event(
            name=f"{self.__class__.__name__}.{method_name()}", run_id=self._settings.run_id, message=message,
            node_state=node_state, hostname=self._node.addr, pid=self._node.pid, local_id=self._node.local_id,
        )
