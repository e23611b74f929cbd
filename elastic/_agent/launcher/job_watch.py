"""The agent's watch over the job's failures: each named on every agent, a bad node set aside, a crash loop stopped.

A `JobWatch` is held by the agent (elastic._agent.launcher.revive_agent), which calls it at each start,
look and stop of its workers. At every look at its workers (`_monitor_workers`) the agent:

1. posts to the job's notice board (elastic._agent.launcher.notice_board) a `failure` entry for each of its
   workers that failed: rank, node, host, exit status or signal, the last step it completed (from the
   worker's progress note, elastic._shared.protocol.worker_notes, so a worker killed without a word is
   named too) and the first line of its exception; and a `hang` entry for each verdict its workers noted
   (elastic._worker.control.hang_names);
2. reads the entries it has not read yet: prints each one's line, and, when its node holds the job's
   event log (rank 0 noted the path), appends the entry as an event, once per entry across the job
   (the board's claim);
3. ends its own workers that a hang of their group named (SIGKILL): the job recovers from the culprit
   now, not at --hang-timeout, and under --survivors keep or train-on only the culprit is replaced;
4. under `--survivors restart` (the default: a failure means a new round), when torch stops its workers
   after a worker of their group failed, on any node (`stop_signal`), ends them with SIGKILL, not SIGTERM: their step cannot complete without the dead peer, and on SIGTERM
   a worker goes on computing until its next collective fails (up to a whole step, traced on a restart);
   the snapshot of the step before was taken as the dead worker's was, so nothing more is lost;
5. after a failure of its own workers, decides (elastic._agent.launcher.failure_policy.decide): restart
   as torch would; set this node aside (`NodeSetAside`: one line, a `node_excluded` entry, a cool-off
   mark, and the agent leaves the rendezvous without closing it, so the others train on); or stop a crash
   loop (`CrashLoopStop`: one line, a `crash_loop` entry, the rendezvous closed, exit status
   `CRASH_LOOP_EXIT` on every agent, since each reads the entry and stops too).

Settings (elastic._agent.launcher.settings): `SET_ASIDE_FAILURES_ENV`, `SET_ASIDE_WINDOW_ENV`,
`SET_ASIDE_COOL_OFF_ENV`, `CRASH_LOOP_ATTEMPTS_ENV`.

Invariants: nothing here raises into torch's agent but the two decisions; a store that fails makes the
board this agent's own for the rest of the run (one warning); every note and mark read is bounded and
checked; a set-aside node's mark (elastic._agent.launcher.set_aside_mark) holds an agent started on its
host back until the cool-off ends.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from elastic._agent.launcher import failure_policy, in_place, set_aside_mark
from elastic._agent.launcher.failure_policy import (
    CRASH_LOOP_ATTEMPTS_ENV,
    CRASH_LOOP_EXIT,
    DEFAULTS,
    SET_ASIDE_COOL_OFF_ENV,
    SET_ASIDE_EXIT,
    SET_ASIDE_FAILURES_ENV,
    SET_ASIDE_WINDOW_ENV,
    Failure,
    NamedHang,
)
from elastic._agent.launcher.hang_verdicts import end_now, replaced_since, since_of
from elastic._agent.launcher.job_entries import (
    COUNTED,
    append_event,
    failure_of,
    hang_entry,
    last_step,
    node_name,
    restart_number,
    world_of,
)
from elastic._agent.launcher.notice_board import Entry, LocalBoard, StoreBoard
from elastic._agent.timings import PRIMARY_WAIT
from elastic._shared.protocol import heal_env, worker_notes

logger = logging.getLogger(__name__)



class CrashLoopStop(Exception):
    """The job stops: a failure repeats at the same step (its `line` says which)."""

    exit_code = CRASH_LOOP_EXIT

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class NodeSetAside(SignalException):
    """This node leaves the job (its workers failed too often while the rest stayed healthy). A
    SignalException to torch's launcher, which then leaves the rendezvous open for the others."""

    exit_code = SET_ASIDE_EXIT

    def __init__(self, line: str) -> None:
        super().__init__(line, signal.SIGTERM)
        self.line = line


def setting(environ: Any, name: str) -> float:
    """A setting's value (checked by settings.resolve before the agent starts; the default when unset)."""
    return float(environ.get(name) or DEFAULTS[name])


class JobWatch:
    """One agent's side (see the module docstring)."""

    def __init__(
        self, agent: Any, worker_group: Any, environ: Any = None, board: Any = None,
        clock: Any = time.monotonic, sleep: Any = time.sleep, heals: Any = None,
    ) -> None:
        """`agent`: the agent it watches for (its restarts: `_restart_workers`, `_remaining_restarts`);
        `board`: the job's notice board (default: in the rendezvous store, else this agent's own);
        `clock` and `sleep` time its bounded waits (a test passes its own); `heals`: the agent's
        heals in place (elastic._agent.launcher.in_place.InPlaceHeals), None without them."""
        self._clock, self._sleep = clock, sleep
        self._env = os.environ if environ is None else environ
        self._agent = agent
        self._heals = heals
        self.started_at: float | None = None
        """When this node's workers of the current group started (time.time()): a failure or a hang posted
        before names an earlier group."""
        self.notes = self._env.get(worker_notes.NOTES_ENV)
        self.board: StoreBoard | LocalBoard = board if board is not None else _board(worker_group, self._env)
        self.failures: list[Failure] = []
        self.hangs: list[NamedHang] = []
        self.stop_line: str | None = None
        self._posted: set[tuple[int, int]] = set()
        self._new_from = 0  # the failures read since the look that saw this node's workers fail
        self._ended: set[int] = set()  # workers this agent ended as a hang's culprits
        self.excluded: set[str] = set()
        """Nodes set aside: their failures count no more."""
        self._trains_on = self._env.get(heal_env.SURVIVORS_ENV) == heal_env.TRAIN_ON  # the launcher checked it
        self.group_broken = False
        """A worker of the group this node's workers are in failed, on any node, since they started, and the
        job restarts on a failure (under keep or train-on the survivors' group heals and goes on)."""
        self._restarts_on_failure = self._env.get(heal_env.SURVIVORS_ENV, heal_env.RESTART) in ("", heal_env.RESTART)
        self.counts = dict.fromkeys(worker_notes.INCIDENTS, 0)
        """The job's primary failures, named hangs and nodes set aside read so far (the metrics' note)."""

    def look(self, worker_group: Any, result: Any) -> None:
        """One look, after torch's (see the module docstring); raises a decision."""
        known = len(self.failures)  # the failures this look reads come after these
        try:
            self._post_hangs(worker_group)
            failed = self._post_failures(worker_group, result)
            left = self.read_board(worker_group)
        except (RuntimeError, OSError, ValueError) as error:  # the store failed: this agent's own board now
            logger.warning("the job's notice board is out of reach (%s); this agent goes on with its own", error)
            self.board = LocalBoard()
            return
        if self.stop_line is not None:
            raise CrashLoopStop(self.stop_line)
        if left and not failed and not (result is not None and result.is_failed()) and not self._trains_on:
            # A node of this round left: this node's workers wait for its workers in a collective; a new round
            # of the nodes left, as for a joiner (not under train-on: they regrouped in place, as for a lost node).
            print("torchrevive-run: a node of this round was set aside: this node's workers start a new round "
                  "without it", file=sys.stderr, flush=True)
            self._agent._restart_workers(worker_group)
        if failed:
            self._new_from = known
            if not any(f.primary for f in self.failures[known:]) and self._loop_may_close():
                self._await_primary(worker_group)  # a peer's failure reached this node: wait for its own word
            self._decide(worker_group)

    def _loop_may_close(self) -> bool:
        """Whether the failure that reached this node could be the one that makes a crash loop (the ones
        before it already died after the same step): only then is it worth waiting for its own entry, and a
        lost node (whose agent posts nothing) costs the others no wait."""
        attempts = int(setting(self._env, CRASH_LOOP_ATTEMPTS_ENV))
        primaries = [f for f in self.failures if f.primary and f.node not in self.excluded]
        if attempts <= 0 or len(primaries) < attempts - 1:
            return False
        return attempts == 1 or len({failure_policy.loop_key(f) for f in primaries[-(attempts - 1):]} - {None}) == 1

    def _await_primary(self, worker_group: Any) -> None:
        """Read the board until the failure that reached this node is posted by its own node's agent (at
        most `PRIMARY_WAIT` seconds): every agent then decides on the same failures."""
        deadline = self._clock() + PRIMARY_WAIT
        while self._clock() < deadline and self.board.shared:
            self._sleep(0.1)
            self.read_board(worker_group)
            if self.stop_line is not None or any(f.primary for f in self.failures[self._new_from:]):
                return

    def _post_hangs(self, worker_group: Any) -> None:
        if not self.notes:
            return
        for local_rank in range(int(worker_group.spec.local_world_size)):
            path = worker_notes.hang_path(self.notes, local_rank)
            note = worker_notes.read_json(path)
            if note is None:
                continue
            path.unlink(missing_ok=True)
            entry = hang_entry(note, worker_group)
            if entry is not None:
                self.board.post(entry)

    def _post_failures(self, worker_group: Any, result: Any) -> bool:
        if result is None or not result.is_failed():
            return False
        now = time.time()
        posted = False
        for rank, process_failure in sorted(result.failures.items()):
            key = (int(rank), int(process_failure.pid))
            if key in self._posted:
                continue
            self._posted.add(key)
            failure = failure_of(process_failure, global_rank=int(rank), notes=self.notes, now=now)
            if int(process_failure.pid) in self._ended:  # the hang that named it counts already
                failure = replace(failure, error="ended as a hang's culprit", primary=False)
            after = f"after step {failure.step}" if failure.step >= 0 else "before its first step"
            line = (f"failure: worker rank {failure.rank} on node {failure.node} (host {failure.host}) "
                    f"{failure_policy.how_it_ended(failure.exitcode)} {after}: {failure.error}"
                    + ("" if failure.primary else " (a peer's failure reached it)"))
            self.board.post(Entry("failure", line, now, failure.step, world_of(worker_group), failure.node,
                                  failure.to_json()))
            posted = True
        return posted

    def read_board(self, worker_group: Any) -> bool:
        """Read the new entries: print each, keep the failures and hangs, write the events this node holds;
        whether another node was set aside among them."""
        left = False
        events = worker_notes.read_events_path(self.notes) if self.notes else None
        entries = self.board.read_new()
        for number, entry in entries:
            if entry.kind == "crash_loop" or (entry.kind == "node_excluded" and entry.node == node_name(self._env)):
                pass  # this agent stops on it: its last line says it (the launcher's)
            else:
                print(f"torchrevive-run: {entry.line}", file=sys.stderr, flush=True)
            if entry.kind == "failure":
                failure = Failure.parse(entry.fields)
                if failure is not None:
                    self.failures.append(failure)
                    started = self.started_at
                    if self._restarts_on_failure and isinstance(started, float) and entry.time >= started:
                        self.group_broken = True
            elif entry.kind == "hang":
                nodes = entry.fields.get("nodes")
                if isinstance(nodes, list):
                    since = since_of(entry.fields) or 0.0
                    self.hangs += [NamedHang(node, entry.time, since) for node in nodes[:64] if isinstance(node, str)]
                self._end_culprits(worker_group, entry)
            elif entry.kind == "node_excluded" and isinstance(entry.fields.get("node"), str):
                self.excluded.add(entry.fields["node"])
                left = left or entry.fields["node"] != node_name(self._env)
            elif entry.kind == "crash_loop":
                self.stop_line = entry.line
                self.board.acknowledge(number)  # the agent that decided it waits for every agent to know
            if events is not None and self.board.claim(number):
                append_event(events, entry, restart=restart_number(self._agent, worker_group))
            if entry.kind in COUNTED:
                self.counts[COUNTED[entry.kind]] += int(entry.kind != "failure" or bool(entry.fields.get("primary")))
        if entries and self.notes:  # the workers' metrics serve these (elastic._worker.observe.metrics)
            worker_notes.note_incidents(self.notes, self.counts)
        return left

    def workers_started(self, worker_group: Any) -> None:
        """This node's workers of a new group start, now: whole again, and without their progress notes (a
        new start's progress is its own: an old note would name another attempt's step)."""
        self.started_at = time.time()
        self.group_broken = False
        if self.notes:
            for local_rank in range(int(worker_group.spec.local_world_size)):
                worker_notes.progress_path(self.notes, local_rank).unlink(missing_ok=True)

    def stop_signal(self) -> signal.Signals:
        """How torch's agent ends this node's workers when it stops them now (see the module docstring, 4)."""
        return signal.SIGKILL if self.group_broken else signal.SIGTERM

    def _end_culprits(self, worker_group: Any, entry: Entry) -> None:
        """End this node's workers a hang of their group named (SIGKILL: a stopped one too), so the
        recovery starts now rather than at --hang-timeout, from the culprit alone: its peers' collective
        fails at once (under --survivors keep or train-on they heal in place and keep their processes)."""
        culprits = entry.fields.get("culprits")
        started = self.started_at
        if not isinstance(culprits, list) or not isinstance(started, float) or entry.time < started:
            return  # not a list, or a hang of a group before this one
        since = since_of(entry.fields)  # (a peer's field: checked like the note's)
        if since is not None:
            culprits = [rank for rank in culprits if not replaced_since(worker_group, rank, since)]
        for rank, pid in end_now(worker_group, culprits):
            print(f"torchrevive-run: ending worker rank {rank} (pid {pid}), the hang's culprit, "
                  "so that the job recovers from it now", file=sys.stderr, flush=True)
            self._ended.add(pid)

    def _decide(self, worker_group: Any) -> None:
        env = self._env
        settings = getattr(worker_group.spec.rdzv_handler, "_settings", None)
        min_nodes = getattr(settings, "min_nodes", 1)
        can_shrink = int(worker_group.group_world_size) > (min_nodes if isinstance(min_nodes, int) else 1)
        decision = failure_policy.decide(
            self.failures, self.hangs, now=time.time(), can_shrink=can_shrink, excluded=self.excluded,
            limit=int(setting(env, SET_ASIDE_FAILURES_ENV)), window=setting(env, SET_ASIDE_WINDOW_ENV),
            attempts=int(setting(env, CRASH_LOOP_ATTEMPTS_ENV)),
        )
        if decision.kind == "set_aside" and decision.node != node_name(env):
            self.excluded.add(decision.node)  # another node leaves (its agent says so): this one trains on
            return
        if decision.kind == "set_aside":
            cool_off = setting(env, SET_ASIDE_COOL_OFF_ENV)
            line = f"{decision.line}; it does not rejoin for {cool_off:g} s (--set-aside-cool-off)"
            fields = {"node": node_name(env), "host": socket.gethostname()[:200], "reason": decision.line,
                      "failures": decision.strikes, "cool_off": cool_off}
            self.board.post(Entry("node_excluded", line, time.time(), last_step(self.failures),
                                  world_of(worker_group), node_name(env), fields))
            self.read_board(worker_group)
            set_aside_mark.write(env, line, cool_off, run_id=worker_group.spec.rdzv_handler.get_run_id())
            in_place.mark_workers_failed(self._heals, worker_group, env)  # train-on: the survivors need not wait
            _leave_rendezvous(worker_group.spec.rdzv_handler)
            raise NodeSetAside(line)
        if decision.kind == "stop":
            failure = decision.failure
            assert failure is not None
            fields = {"rank": failure.rank, "node": failure.node, "host": failure.host, "error": failure.error,
                      "attempts": int(setting(env, CRASH_LOOP_ATTEMPTS_ENV)), "exit_code": CRASH_LOOP_EXIT}
            if self.stop_line is None and self.board.claim("crash_loop"):  # the first agent to decide posts it
                number = self.board.post(Entry("crash_loop", decision.line, time.time(), failure.step,
                                               world_of(worker_group), node_name(env), fields))
                self.read_board(worker_group)
                self._await_acknowledgements(number, int(worker_group.group_world_size))
            raise CrashLoopStop(self.stop_line or decision.line)

    def crash_loop_line(self) -> str | None:
        """The crash-loop line another agent posted, read now (the rendezvous it closed ended this agent's
        wait); None when there is none, or the board is out of reach."""
        if self.stop_line is None:
            try:
                for _, entry in self.board.read_new():
                    if entry.kind == "crash_loop":
                        self.stop_line = entry.line
            except (RuntimeError, OSError, ValueError):
                return None
        return self.stop_line

    def _await_acknowledgements(self, number: int, agents: int) -> None:
        """Until every agent of the round has read the stop (at most `PRIMARY_WAIT` seconds): this agent may
        host the store the others read it from."""
        deadline = self._clock() + PRIMARY_WAIT
        while self.board.acknowledged(number) < agents and self._clock() < deadline:
            self._sleep(0.1)


def _board(worker_group: Any, environ: Any) -> StoreBoard | LocalBoard:
    from elastic._agent.launcher.in_place import heal_store

    store = heal_store(worker_group.store)
    if store is None:
        print("torchrevive-run: this rendezvous has no TCP store: each agent names only its own node's failures",
              file=sys.stderr, flush=True)
        return LocalBoard()
    handler = worker_group.spec.rdzv_handler
    return StoreBoard(store, handler.get_run_id(), environ, changes=getattr(handler, "changes", None))


def _leave_rendezvous(handler: Any) -> None:
    """Leave torch's dynamic rendezvous without closing it: the other nodes see one node fewer at once
    instead of after its keep-alive runs out (torch's own exit step; a handler without it: the keep-alive)."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            _RendezvousExitOp,
        )

        handler._stop_heartbeats()
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10)
    except Exception as error:  # noqa: BLE001 - the others still see it gone when its keep-alive runs out
        logger.warning("leaving the rendezvous: %s; the other nodes see this one gone after its keep-alive", error)
