"""Surviving a peer's death in place: leave the broken process group and form the next one
in the same process, at the same rank and world size.

This is the worker's half of "survivors never stop" (issue 28): a worker whose
peer died keeps its process, its model, optimizer, sampler and loader workers;
only the dead worker's replacement is a new process, and it takes its state
from a survivor over the new group (elastic._worker.survivors.catch_up).
torchrevive-run's agent does its half with TORCHREVIVE_SURVIVORS=keep
(elastic._agent.launcher.in_place); a DDP script calls these pieces itself
(tests/heal_worker.py is one), and `elastic.Run` through
elastic._worker.survivors.healing (with `train-on`, the groups it forms are
elastic._worker.survivors.views'). A step that fails is void, not an exception,
and DDP's reducer follows the group: elastic._worker.survivors.ddp_rebind.

How the next group forms (`leave`, then `rejoin`):
- A survivor lets go of the broken group as soon as its step is void (`leave`):
  its sockets close, and the peers still blocked in the collective fail at once.
- Every member (survivors and the replacement) builds the default group anew
  on a namespace of a store that outlived the dead worker (`group/<generation>`
  under the round's heal namespace), at the same rank and world size, and counts
  itself among the round's healers (the agent heals in place only when every
  worker of the round did: a script that cannot heal gets torch's new round).
- A member notes the generation it arrives at before the group forms (`member_key`):
  a member that dies while the group forms, or before it noted anything else, has
  its agent heal into the generation after (heal_env.healed_generation), and the
  others, waiting for it inside torch on a watched store (forming_store), give that
  group up as soon as the heal count moved past it (`superseded`): `GroupBroken`.

Invariants:
- A group is built only once the last one is gone (`require_left`).
- Every failure of a heal (a store that failed, a peer that never came, a
  collective that broke again) is a `RegroupError`, one line; a worker exits
  with its status (76), and its agent then holds a new round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic._shared.common.errors import ElasticError, EnvironmentConfigError
from elastic._shared.common.errors import first_line as _first_line
from elastic._shared.protocol import heal_env
from elastic._shared.storage.peer_auth import PeerKey, SecretError
from elastic._shared.storage.store_records import Records, strict_count
from elastic._worker.survivors.forming_store import FormingStore, given_up
from elastic._worker.survivors.groups import PROCESS, Groups, NotLeft
from elastic._worker.survivors.heal_store import heal_store
from elastic._worker.timings import REGROUP_POLL_S as _POLL_S

logger = logging.getLogger(__name__)


class RegroupError(ElasticError):
    """The members of a heal did not all come in time; the worker should exit with
    `heal_env.HEAL_FAILED_EXIT`, after which its agent starts a new round."""

    exit_code = heal_env.HEAL_FAILED_EXIT


class GroupBroken(RegroupError):
    """A collective of a newly formed group failed: a member died during the heal, which
    starts over with the next generation (the dead member's agent heals it too)."""


@dataclass(frozen=True)
class HealPoint:
    """Where this worker's heals meet (see elastic._shared.protocol.heal_env)."""

    store: dist.Store
    """The round's namespace of the rendezvous store."""
    generation: int
    """The heal this worker was started by: 0 at the start of a round (with `train-on`: its incarnation)."""
    mode: str = heal_env.KEEP
    """`heal_env.KEEP` or `heal_env.TRAIN_ON`."""
    rank: int = 0
    """This worker's rank at the round's start (torchrun's RANK)."""
    world_size: int = 1
    """The round's world size (torchrun's WORLD_SIZE)."""
    min_world: int = 1
    """With `train-on`: the fewest workers the job may train with."""
    local_rank: int = 0
    local_world_size: int = 1
    """This worker's place on its node: its agent started ranks `rank - local_rank` on, `local_world_size` of them."""
    records: Records | None = None
    """`store`'s records sealed with the job's secret (store_records); `signed_records` gives them."""

    @property
    def signed_records(self) -> Records:
        return self.records if self.records is not None else Records(self.store, world=self.world_size)


def heal_point(environ: Mapping[str, str], timeout: timedelta = timedelta(seconds=60)) -> HealPoint | None:
    """The heal point torchrevive-run gives its workers with TORCHREVIVE_SURVIVORS=keep or train-on;
    None without one. A malformed variable is an `EnvironmentConfigError` (one line)."""
    address = environ.get(heal_env.HEAL_STORE_ENV)
    if not address:
        return None
    try:  # the agent sets these variables only with a setting that heals; unset, it is `keep`'s
        mode = heal_env.mode(environ) if environ.get(heal_env.SURVIVORS_ENV) else heal_env.KEEP
    except ValueError as error:
        raise EnvironmentConfigError(str(error)) from None
    if mode == heal_env.RESTART:
        return None
    place = {}
    for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), (heal_env.MIN_WORLD_ENV, "1"), ("LOCAL_RANK", "0"),
                          ("LOCAL_WORLD_SIZE", "1")):
        raw = environ.get(name) or default
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
            raise EnvironmentConfigError(f"{name}={raw!r} is not a count")
        place[name] = int(raw)
    host, _, port = address.rpartition(":")
    namespace = environ.get(heal_env.HEAL_NAMESPACE_ENV, "")
    generation = environ.get(heal_env.HEAL_GENERATION_ENV, "0")
    if not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or not 0 < int(port) < 65536:
        raise EnvironmentConfigError(f"{heal_env.HEAL_STORE_ENV}={address!r} is not HOST:PORT")
    if not namespace:
        raise EnvironmentConfigError(f"{heal_env.HEAL_NAMESPACE_ENV} is not set beside {heal_env.HEAL_STORE_ENV}")
    if strict_count(generation, most=heal_env.MAX_GENERATION) is None:
        raise EnvironmentConfigError(f"{heal_env.HEAL_GENERATION_ENV}={generation!r} is not a count")
    try:  # the job's secret seals the round's records (the agent hands the workers a file: never the secret)
        key = PeerKey.from_env(environ)
    except SecretError as error:
        raise EnvironmentConfigError(str(error)) from None
    try:
        heals = heal_store(environ, host.strip("[]"), int(port), namespace, key, timeout)
    except RuntimeError as error:
        raise RegroupError(f"cannot reach the rendezvous store at {address}: {_first_line(error)}") from None
    world_size = max(place["WORLD_SIZE"], 1)
    return HealPoint(
        heals, int(generation), mode=mode,
        rank=place["RANK"], world_size=world_size, min_world=max(place[heal_env.MIN_WORLD_ENV], 1),
        local_rank=min(place["LOCAL_RANK"], place["RANK"]), local_world_size=max(place["LOCAL_WORLD_SIZE"], 1),
        records=Records(heals, key=key, scope=namespace, world=world_size),
    )


def next_generation(point: HealPoint, after: int, timeout: timedelta = timedelta(seconds=60)) -> int:
    """Wait until an agent has counted a heal past generation `after` (it has started the
    replacements by then) and return the newest count; `RegroupError` after `timeout`."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            generation = point.store.add(heal_env.GENERATION_KEY, 0)
        except RuntimeError as error:  # the rendezvous store's agent is gone
            raise RegroupError(f"the rendezvous store failed while waiting for heal {after + 1}: "
                               f"{_first_line(error)}") from None
        if generation > heal_env.MAX_GENERATION:  # a counter anyone may raise: one line, a new round
            raise RegroupError(f"the round's heal count in the rendezvous store ({generation}) is not one")
        if generation > after:
            return generation
        if time.monotonic() > deadline:
            raise RegroupError(f"no agent replaced the failed worker within {timeout} (heal {after + 1} never began)")
        time.sleep(_POLL_S)


def leave(model: DistributedDataParallel | None = None) -> None:
    """Let go of the broken group now (groups.ProcessGroups.leave: why at once)."""
    PROCESS.leave(model)


def require_left(purpose: str, groups: Groups = PROCESS) -> None:
    """`RegroupError` unless the last group is gone (groups.ProcessGroups.require_left)."""
    try:
        groups.require_left(purpose)
    except NotLeft as error:
        raise RegroupError(str(error)) from None


def rejoin(
    store: dist.Store, *, generation: int, rank: int, world_size: int,
    timeout: timedelta = timedelta(minutes=5), records: Records | None = None, groups: Groups = PROCESS,
) -> None:
    """Leave the current default group without waiting on a peer (it may be dead), then
    build the default group again on `store` under generation `generation`'s namespace.

    Every member of the new group calls this with the same generation; a replacement,
    which has no group yet, calls it too. Blocks until all `world_size` members joined
    (torch's own store handshake), at most `timeout`. `records`: `store`'s, sealed (default: unsealed);
    `groups`: where the group lives (default: this process's default group). Heals in place run on gloo."""
    if groups.formed():
        groups.leave()
    require_left(f"heal {generation}", groups)
    records = records if records is not None else Records(store, world=world_size)
    try:
        records.set(heal_env.member_key(rank), str(generation))  # arrived: its death now heals past this one
        groups.form(heal_group_store(store, generation), rank=rank, world_size=world_size, timeout=timeout)
        count_healer(records, rank=rank, generation=generation)
    except RuntimeError as error:  # DistStoreError: a member never came; DistNetworkError: the store is gone
        if given_up(error):  # a member died while it formed: the next generation's group, with its replacement
            raise GroupBroken(f"rank {rank}, heal {generation}: {_first_line(error)}") from None
        raise RegroupError(f"rank {rank}: the group of heal {generation} did not form: {_first_line(error)}") from None


def heal_group_store(store: dist.Store, generation: int) -> dist.Store:
    """Where the default group of heal `generation` meets (0: the round's first group), watched: a wait
    there gives up once the heal count moved past `generation` (forming_store)."""
    return dist.PrefixStore(f"group/{generation}", FormingStore(store, lambda twin: superseded(twin, generation)))


def superseded(store: dist.Store, generation: int) -> str | None:
    """Why the group of heal `generation` is given up (None: it is not): an agent counted a later heal,
    which it does only once a member that had arrived at this one died."""
    current = store.add(heal_env.GENERATION_KEY, 0)
    if current > generation:
        return f"heal {current} began: a member of heal {generation}'s group died while it formed"
    return None


def count_healer(records: Records, *, rank: int, generation: int) -> None:
    """Note that this worker joined generation `generation`'s group (a sealed record its agent reads),
    and count it among the round's healers (it turns a failed step into a void one and heals): the
    agent heals in place only when every worker of the round has counted itself."""
    records.set(heal_env.member_key(rank), str(generation))
    records.store.add(heal_env.HEALERS_KEY, 1)
