"""`ReviveAgent`: the agent `torchrevive-run` runs, torch's `LocalElasticAgent` and what recovery adds.

torch's agent loop (`SimpleElasticAgent._invoke_run`) is left as it is: rendezvous, start the workers,
then look at them every monitor interval; a failure restarts them (stop, a new round, start) while
restarts remain, a membership change restarts them too, and a group that succeeded waits in the exit
barrier. `ReviveAgent` overrides the steps of that loop, each calling torch's own (`super()`), in
the order of a run: a worker start (and each worker's environment), a look at the workers, a stop,
a restart, the exit barrier.
What it adds is done by collaborators it holds:

- `death_watch.DeathWatch`: the wait before each look ends the moment a worker dies;
- `job_watch.JobWatch`: every failure named on every agent, a bad node set aside, a crash loop stopped,
  a hang's culprit ended, a broken group stopped with SIGKILL;
- `in_place.InPlaceHeals` (`--survivors keep` or `train-on`): a failed worker replaced without a round;
- the snapshot keeper (elastic._agent.launcher.keeper), told each time the workers stopped.

`launch_agent` builds it as torch's `launch_agent` builds its agent, from torch's launch config.

Invariants:
- No attribute of torch is replaced: what differs from torch's agent is in this class's methods.
- Each override calls torch's method (a look: once, or again while a death is not yet heard of), except
  where it stands in for it (a heal in place for a new round; train-on's exit barrier); what it adds
  runs in the order the patches it replaced ran (tests/unit/test_revive_agent.py holds it).
- A worker that exits with one of `final_exits` ends the job: torch's loop takes its branch for no
  restarts left (stop the workers, return FAILED) instead of training into the same failure.
- Nothing a collaborator raises into torch's loop but the job watch's two decisions (`NodeSetAside`,
  a SignalException: the rendezvous stays open for the others; `CrashLoopStop`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.launcher.api import LaunchConfig

from elastic._agent.launcher import exit_barrier, in_place, stop_signals
from elastic._agent.launcher.death_watch import TORCH_SLEEP, DeathWatch
from elastic._agent.launcher.hang_verdicts import end_now
from elastic._agent.launcher.job_watch import CrashLoopStop, JobWatch

if TYPE_CHECKING:
    from elastic._agent.launcher.keeper import SnapshotKeeper

logger = logging.getLogger(__name__)


class ReviveAgent(LocalElasticAgent):
    """torch's local agent with the collaborators of the module docstring, called at each step."""

    def __init__(
        self, spec: WorkerSpec, *, look_every: float, keeper: SnapshotKeeper | None = None,
        final_exits: frozenset[int] = frozenset(), environ: Any = None, **torch_options: Any,
    ) -> None:
        """`look_every`: the user's --monitor-interval (torch's loop sleeps only `TORCH_SLEEP`; the death
        watch waits the rest); `keeper`: this node's snapshot keeper, or None; `final_exits`: the worker
        exit statuses a restart cannot fix; `torch_options`: `LocalElasticAgent`'s own."""
        super().__init__(spec, **torch_options)
        self._env = env = os.environ if environ is None else environ
        self.death_watch = DeathWatch(look_every)
        self.heals = in_place.InPlaceHeals(env) if in_place.enabled(env) else None
        self.job_watch: JobWatch | None = None
        """Made at the first start of the workers: its notice board is in the first round's store."""
        self.keeper = keeper
        self.final_exits = final_exits
        self.counts_live_nodes = self.heals is not None and self.heals.train_on
        """train-on: a job may end without a node it lost, so the exit barrier waits for the live ones."""
        self._start_env: dict[str, str] = {}
        """What the start under way adds to each worker's environment (the heals' variables)."""

    # A worker start: torch's first one, each restart's, and each heal's.

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._watch(worker_group).workers_started(worker_group)  # a hang or failure posted before: an earlier group's
        self._start_env = self.heals.worker_env(worker_group) if self.heals is not None else {}
        try:
            started = super()._start_workers(worker_group)
        finally:
            self._start_env = {}
        stop_signals.guard_torch_handlers()  # torch registered its stop-signal handler again
        return started

    def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None:
        """torch's per-worker variables (its `_start_workers` calls this for each worker), and the start's own."""
        super()._set_local_rank_env(worker_env, local_rank, spec)
        worker_env.update(self._start_env)

    # A look at the workers: torch's loop calls it after each sleep.

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        pids = set(self._pcontext.pids().values()) if self._pcontext is not None else set()
        return self.death_watch.look(pids, lambda: self._look(worker_group))

    def _look(self, worker_group: WorkerGroup) -> RunResult:
        """torch's look, then what this agent makes of it; the job watch may restart the workers (a node set
        aside elsewhere) or raise a decision."""
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and any(failure.exitcode in self.final_exits for failure in result.failures.values()):
            self._remaining_restarts = 0  # torch's loop then stops the workers and returns FAILED
        if self.heals is not None:
            self.heals.last_result = result  # the failure a heal acts on
        self._watch(worker_group).look(worker_group, result)
        return result

    # A stop: before a restart, a heal, and at the end of a failed job.

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        try:
            if self.job_watch is not None and self.job_watch.stop_signal() == signal.SIGKILL:
                end_now(worker_group)  # a broken group: torch's SIGTERM then finds them gone
            super()._stop_workers(worker_group)
        finally:
            if self.keeper is not None:
                self.keeper.workers_stopped()  # it persists the newest snapshot it holds

    # A restart: after a failure (while restarts remain) and for a membership change.

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if self.heals is not None and self.heals.heal(self, worker_group):
            return  # replaced in place: no round, the other nodes' workers keep their processes
        super()._restart_workers(worker_group)

    # The exit barrier: the workers succeeded.

    def _exit_barrier(self) -> None:
        if not self.counts_live_nodes:
            return super()._exit_barrier()
        exit_barrier.wait_for_live_nodes(self._store, self._worker_group.spec.rdzv_handler,
                                         timeout=self._exit_barrier_timeout)
        return None

    def _watch(self, worker_group: WorkerGroup) -> JobWatch:
        if self.job_watch is None:
            self.job_watch = JobWatch(self, worker_group, self._env, heals=self.heals)
        return self.job_watch


def launch_agent(config: LaunchConfig, entrypoint: Any, args: list[Any], *, keeper: SnapshotKeeper | None = None,
                 final_exits: frozenset[int] = frozenset()) -> dict[int, Any]:
    """Run a `ReviveAgent` for torch's launch `config` (torch.distributed.run's `config_from_args`) and the
    workers' `entrypoint` and `args`, as torch's `launch_agent` runs its agent; the workers' return values.

    Raises ChildFailedError when the workers failed (torch's `record` reports it), and what the agent
    raised otherwise. The rendezvous is shut down at the end, unless the agent was stopped by a signal
    (a node set aside is one): shutting it down would close the run for every node. An agent whose
    rendezvous another agent closed on a crash loop raises `CrashLoopStop` with that agent's line."""
    run_id = config.run_id or str(uuid.uuid4().int)  # torch's fallback (torchrun's own default id is "none")
    logger.info("starting the agent: %s, run %s, %s to %s nodes of %s workers, backend %s at %s",
                _entrypoint_name(entrypoint, args), run_id, config.min_nodes, config.max_nodes,
                config.nproc_per_node, config.rdzv_backend, config.rdzv_endpoint)
    parameters = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=run_id, min_nodes=config.min_nodes,
        max_nodes=config.max_nodes, local_addr=config.local_addr, **config.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # read at each worker start
    # torchrevive-run's backends are never torch's static one (handlers.launcher_backend): the round
    # names the workers' master address and port, so the spec names none.
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
        rdzv_handler=rendezvous_registry.get_rendezvous_handler(parameters), max_restarts=config.max_restarts,
        monitor_interval=TORCH_SLEEP, local_addr=config.local_addr, event_log_handler=config.event_log_handler,
        numa_options=config.numa_options, duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters, virtual_local_rank=config.virtual_local_rank,
    )
    agent = ReviveAgent(
        spec, look_every=config.monitor_interval, keeper=keeper, final_exits=final_exits,
        logs_specs=config.logs_specs, start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template, shutdown_timeout=config.shutdown_timeout,
    )
    try:
        return _run(agent, spec, config, _entrypoint_name(entrypoint, args))
    except RendezvousClosedError:
        line = agent.job_watch.crash_loop_line() if agent.job_watch is not None else None
        if line is None:
            raise
        raise CrashLoopStop(line) from None


def _run(agent: ReviveAgent, spec: WorkerSpec, config: LaunchConfig, name: str) -> dict[int, Any]:
    """`agent.run()` with torch's metrics and events around it, and the rendezvous shut down after."""
    shut_down = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)  # the agent ran, whatever the workers did
        if result.is_failed():
            raise ChildFailedError(name=name, failures=result.failures)
        return result.return_values
    except ChildFailedError:
        raise
    except SignalException:
        shut_down = False  # the others, and a node that replaces this one, go on in the same rendezvous
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shut_down:
            spec.rdzv_handler.shutdown()


def _entrypoint_name(entrypoint: Any, args: list[Any]) -> str:
    """The workers' program as torch names it in a failure: a function's name, the script a Python
    interpreter runs (its first argument that is not an option), or the command."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", "")
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(arg) for arg in args if not str(arg).startswith("-")), "")
        return entrypoint
    return ""
