"""A fresh namespace of torchrun's shared worker store for every rendezvous round.

Stock torchrun (TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset) gives the workers of
every round the same TCPStore, served by the rank-0 node's agent for the whole
job (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
`next_rendezvous`), and torch's env:// rendezvous connects workers to it with no
per-round prefix (torch/distributed/rendezvous.py, `_create_c10d_store`). A
process group's keys (gloo's address of every rank) therefore outlive their
round: a worker of the next round that reads a peer's key before the peer has
rewritten it connects to a dead process and the round fails.

`round_store` gives `init_process_group` a `PrefixStore` over the agent store
whose prefix, `torchrevive/round/<T>/`, is a token T that every worker of this
round agrees on and no earlier round used. The workers agree through a
handshake on the agent store (keys under `torchrevive/`):

1. rank 0 draws T at random (uuid4);
2. every rank r > 0 draws a token v of its own, appends `r:v;` to `hellos` and
   waits for `reply/v`;
3. rank 0 reads `hellos` over and over, writes `reply/v` = T for every v it
   has not answered yet, and clears what it has answered (compare-and-set, so an
   append it has not read survives);
4. rank r reads T from `reply/v`, adds 1 to `joined/T` and builds its process
   group under `round/T/`;
5. rank 0 returns once `joined/T` counts world_size - 1 ranks, and deletes the
   `reply/` keys it wrote and `joined/T`.

Invariants:
- `reply/v` is written only by a rank 0 that read v after rank r appended it,
  since v was drawn fresh by rank r: rank r takes T from this round's rank 0
  and from no one else, whatever a dead round left in the store.
- T is fresh, so no key under `round/T/` or `joined/T` exists before this
  round writes it: the process group never reads a dead round's key, and rank
  0 counts only ranks that learned T in step 4.
- A hello left by a round that died in the middle of its handshake gets a
  reply that no one reads; it is deleted with the others in step 5.
- Every wait is bounded by the timeout given (the collective timeout); running
  out raises `RoundStoreError`, one line that says what to do.
- Assumed, as torch's agent ensures: a dead round's workers are gone before the
  next round's start (the agent stops its group, SIGKILL after a grace, before
  it rejoins the rendezvous).
- What a round leaves in the store is its process group's own keys (a few per
  rank, under `round/T/`); the handshake's keys are deleted.

The static rendezvous shares its agent store too, whatever the variable says.
With the agent store not shared (a dynamic rendezvous under
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which our launcher sets: each round gets a
store of its own), plain env:// or a single process, `round_store` returns None
and the process group is built as torch builds it.

What a worker cannot change is in the agents: a dynamic rendezvous of MIN < MAX
nodes waits `last_call_timeout` (30 s by default) in every round, and with the
shared store a node that joins after the first round waits for a store address
no agent publishes again. `recovery_hint` is the one line that leads plain
torchrun users to the settings that remove both.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from elastic._shared.common.errors import ElasticError
from elastic._shared.common.errors import first_line as _first_line
from elastic._shared.protocol.recovery_defaults import FRESH_STORE_ENV, merged_rdzv_conf
from elastic._worker.timings import (
    LISTENER_POLL_S as _LISTENER_POLL_S,
    LISTENER_WAIT_S,
    ROUND_POLL_FIRST_S as _POLL_FIRST_S,
    ROUND_POLL_MAX_S as _POLL_MAX_S,
)

logger = logging.getLogger(__name__)

PREFIX = "torchrevive/"
HELLOS = PREFIX + "hellos"
_FAST_PATH = (
    "run the job with torchrevive-run (python -m elastic._agent.launcher), or export "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun"
)


class RoundStoreError(ElasticError):
    """The workers of a round could not agree on their store namespace in time."""


def uses_agent_store(environ: Mapping[str, str]) -> bool:
    """torchrun tells its workers to share the agent's store (its default)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def round_store(
    environ: Mapping[str, str], *, rank: int, world_size: int, timeout: timedelta
) -> dist.Store | None:
    """The store for this worker's `init_process_group`: a fresh namespace of
    torchrun's shared agent store, or None when torchrun does not share one
    (then torch's env:// rendezvous applies as usual)."""
    if not uses_agent_store(environ):
        if rank != 0 and environ.get("TORCHELASTIC_RUN_ID"):
            await_store_server(environ, deadline=time.monotonic() + min(timeout.total_seconds(), LISTENER_WAIT_S))
        return None
    store = connect_agent_store(environ, rank=rank, timeout=timeout)
    return agree_on_round(store, rank=rank, world_size=world_size, timeout=timeout, where=_where(environ))


def await_store_server(environ: Mapping[str, str], *, deadline: float) -> bool:
    """Wait (until `deadline`, monotonic) for rank 0's store server at MASTER_ADDR:MASTER_PORT to
    accept connections; True once it does. False (torch's own client then waits as usual)
    when the address is unreadable or the deadline passes.

    Why: rank 0 starts that server inside `init_process_group`, and a rank that connects
    first is refused and retried by TCPStore's client after a backoff of about 0.5 s, on
    the path of every restart. A bare connect, closed at once, costs the server nothing."""
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        return False
    while True:
        try:
            with socket.create_connection((addr, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_LISTENER_POLL_S)


def connect_agent_store(environ: Mapping[str, str], *, rank: int, timeout: timedelta) -> dist.Store:
    """A client of the store torchrun's agent serves at MASTER_ADDR:MASTER_PORT."""
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if not addr or not port.isdigit():
        raise RoundStoreError(
            f"rank {rank}: TORCHELASTIC_USE_AGENT_STORE=True but MASTER_ADDR={addr!r} MASTER_PORT={port!r} "
            "do not name the agent's store; start workers with torchrun"
        )
    try:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    except RuntimeError as exc:
        raise RoundStoreError(
            f"rank {rank}: cannot reach torchrun's agent store at {addr}:{port} within {timeout}: "
            f"{_first_line(exc)}"
        ) from exc


def agree_on_round(
    store: dist.Store, *, rank: int, world_size: int, timeout: timedelta, where: str = "the agent store"
) -> dist.PrefixStore:
    """Run the handshake of the module docstring on `store`; every rank of the
    round gets a `PrefixStore` on the same fresh namespace."""
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        if rank == 0:
            token = _RoundHost(store, world_size).serve(deadline)
        else:
            token = _join(store, rank, deadline)
    except RuntimeError as exc:  # the store itself failed (its server is gone)
        raise RoundStoreError(f"rank {rank}: torchrun's agent store ({where}) failed: {_first_line(exc)}") from exc
    except _OutOfTime as late:
        raise RoundStoreError(f"rank {rank}: {late} within {timeout} through {where}; {_SPLIT_HINT}") from None
    logger.debug("rank %d: round store namespace %s", rank, token)
    return dist.PrefixStore(f"{PREFIX}round/{token}/", store)


_SPLIT_HINT = (
    "a peer died before it joined (the agent restarts the group), or the rank-0 node changed "
    "between rounds and torch's shared store split in two (the old rank-0 agent still serves "
    f"its own): {_FAST_PATH}"
)


class _OutOfTime(Exception):
    """A wait of the handshake reached its deadline (the message says which)."""


class _RoundHost:
    """Rank 0's side: answers every hello with the round's token until all have joined."""

    def __init__(self, store: dist.Store, world_size: int, token: str | None = None) -> None:
        self.store = store
        self.world_size = world_size
        self.token = token or uuid.uuid4().hex
        self.handled = b""
        """The value of `hellos` already answered (cleared from the store when unchanged)."""
        self.answered: set[str] = set()
        self.joined_key = f"{PREFIX}joined/{self.token}"

    def poll(self) -> int:
        """Answer the hellos appended since the last poll; returns how many ranks joined."""
        current = self.store.compare_set(HELLOS, self.handled, b"")
        if current != b"" and current != self.handled:
            fresh = current.removeprefix(self.handled)  # all of it if rank 0's clear went through
            for entry in filter(None, fresh.decode().split(";")):
                hello = entry.rpartition(":")[2]
                if hello and hello not in self.answered:
                    self.store.set(f"{PREFIX}reply/{hello}", self.token)
                    self.answered.add(hello)
        self.handled = current
        return self.store.add(self.joined_key, 0)

    def serve(self, deadline: float) -> str:
        interval = _POLL_FIRST_S
        joined = self.poll()
        while joined < self.world_size - 1:
            if time.monotonic() > deadline:
                raise _OutOfTime(f"{joined} of the {self.world_size - 1} other ranks joined this round")
            time.sleep(interval)
            before = len(self.answered), joined
            joined = self.poll()
            interval = _POLL_FIRST_S if (len(self.answered), joined) != before else min(interval * 1.5, _POLL_MAX_S)
        self._clean_up()
        return self.token

    def _clean_up(self) -> None:
        """Delete the handshake's keys; best effort (a leftover is never read again)."""
        try:
            self.store.compare_set(HELLOS, self.handled, b"")
            for hello in self.answered:
                self.store.delete_key(f"{PREFIX}reply/{hello}")
            self.store.delete_key(self.joined_key)
        except RuntimeError:
            logger.debug("cleaning the handshake's keys failed", exc_info=True)


def _join(store: dist.Store, rank: int, deadline: float) -> str:
    """Rank r's side: say hello with a fresh token, take the round's token from the reply."""
    hello = uuid.uuid4().hex
    store.append(HELLOS, f"{rank}:{hello};")
    reply = f"{PREFIX}reply/{hello}"
    try:
        store.wait([reply], timedelta(seconds=max(0.001, deadline - time.monotonic())))
    except dist.DistStoreError:
        raise _OutOfTime("rank 0 of this round never answered") from None
    token = store.get(reply).decode()
    store.add(f"{PREFIX}joined/{token}", 1)
    return token


def _where(environ: Mapping[str, str]) -> str:
    return (
        f"torchrun's agent store {environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')} "
        f"(run {environ.get('TORCHELASTIC_RUN_ID', '?')})"
    )



def recovery_hint(environ: Mapping[str, str], agent_argv: list[str] | None = None) -> str | None:
    """One line for a job whose torchrun settings cost recoveries what no worker can
    win back, naming the fast path; None when there is nothing to say.

    Said when restarts are allowed (TORCHELASTIC_MAX_RESTARTS > 0) and either:
    - the dynamic rendezvous shares its agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE
      unset): a node that joins after the first round (scale-up, a replaced node)
      waits for a store address no agent publishes again (torch's
      dynamic_rendezvous.py `next_rendezvous`), its rendezvous times out and the
      job fails; or
    - MIN < MAX nodes and --rdzv-conf leaves last_call_timeout at torch's 30 s,
      which every recovery waits.
    `agent_argv` is torchrun's own arguments (default: read from /proc, its command
    line as the worker's parent, best effort). Our launcher sets the variable and
    starts workers from a fork server, so it gets no hint; an unknown parent of a
    worker told to use the agent store counts as torchrun with its defaults.
    """
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if not restarts.isdigit() or int(restarts) == 0:
        return None
    fresh_stores = environ.get(FRESH_STORE_ENV) == "1"
    args = _torchrun_args(agent_argv if agent_argv is not None else _parent_torchrun_argv())
    if args is None and (fresh_stores or not uses_agent_store(environ)):
        return None  # our launcher, or no torchrun we can see
    dynamic = args is None or args.rdzv_backend != "static"
    late_joins_fail = dynamic and not fresh_stores
    last_call = args is None or (dynamic and _waits_last_call(args))
    if not (late_joins_fail or last_call):
        return None
    problems = []
    if late_joins_fail:
        problems.append(
            "with its shared worker store a node that joins after the first round (scale-up, a replaced "
            "node) times the rendezvous out"
        )
    if last_call:
        problems.append("every recovery waits the rendezvous' 30 s last call")
    torchrun = " ".join(
        ([f"{FRESH_STORE_ENV}=1"] if late_joins_fail else [])
        + ["torchrun"]
        + ([f"--rdzv-conf={merged_rdzv_conf('')}"] if last_call else [])
    )
    return (
        f"run {environ.get('TORCHELASTIC_RUN_ID', '?')}: under plain torchrun {' and '.join(problems)}; "
        f"use torchrevive-run (python -m elastic._agent.launcher, same flags), or {torchrun}"
    )


def _torchrun_args(agent_argv: list[str] | None) -> argparse.Namespace | None:
    """torchrun's parse of its own arguments (PET_* variables included); None when unknown."""
    if agent_argv is None:
        return None
    from torch.distributed.run import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = get_args_parser().parse_known_args(agent_argv)
    except SystemExit:
        return None
    return args


def _waits_last_call(args: argparse.Namespace) -> bool:
    """MIN < MAX nodes and no last_call_timeout in --rdzv-conf (or PET_RDZV_CONF)."""
    low, _, high = str(args.nnodes).partition(":")
    keys = {item.split("=", 1)[0].strip() for item in (args.rdzv_conf or "").split(",")}
    return high not in ("", low) and "last_call_timeout" not in keys


def _parent_torchrun_argv() -> list[str] | None:
    """torchrun's arguments from its command line: torchrun starts a script's workers
    as its own children. None when unreadable or when the parent is not torchrun."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return None
    for i, arg in enumerate(argv):
        if arg == "torch.distributed.run" and i > 0 and argv[i - 1] == "-m":
            return argv[i + 1:]
        if os.path.basename(arg) == "torchrun":
            return argv[i + 1:]
    return None
