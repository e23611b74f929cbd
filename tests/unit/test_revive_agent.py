"""`ReviveAgent` (elastic._agent.launcher.revive_agent): torch's agent, each step overridden in the order of a
run and calling torch's own, with the death watch, the job watch, the heals and the keeper as its collaborators;
`launch_agent` runs it as torch's `launch_agent` runs torch's."""

from __future__ import annotations

import signal
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed.elastic.multiprocessing.api as mp_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
from torch.distributed.launcher.api import LaunchConfig

from elastic._agent.launcher import revive_agent, stop_signals
from elastic._agent.launcher.job_watch import CrashLoopStop, NodeSetAside
from elastic._agent.launcher.revive_agent import ReviveAgent
from elastic._shared.protocol import heal_env


class Handler:
    """A rendezvous handler as the agent sees it before any round."""

    def __init__(self) -> None:
        self.shut_down = 0

    def get_run_id(self) -> str:
        return "run"

    def get_backend(self) -> str:
        return "test"

    def shutdown(self) -> bool:
        self.shut_down += 1
        return True


def make_agent(survivors: str = "restart", **options: Any) -> ReviveAgent:
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=Handler(), entrypoint="python",
                      monitor_interval=0.001)
    return ReviveAgent(spec, look_every=0.001, environ={heal_env.SURVIVORS_ENV: survivors},
                       logs_specs=DefaultLogsSpecs(), **options)


class Watch:
    """A job watch that notes what the agent asks of it."""

    def __init__(self, calls: list[Any], stop_signal: signal.Signals = signal.SIGTERM) -> None:
        self.calls, self._signal = calls, stop_signal

    def workers_started(self, worker_group: Any) -> None:
        self.calls.append("watch: started")

    def look(self, worker_group: Any, result: Any) -> None:
        self.calls.append(("watch: look", result))

    def stop_signal(self) -> signal.Signals:
        return self._signal


def test_the_agent_is_torchs_with_each_step_overridden_in_the_order_of_a_run() -> None:
    assert issubclass(ReviveAgent, LocalElasticAgent)
    steps = [name for name in vars(ReviveAgent) if callable(getattr(LocalElasticAgent, name, None))]
    assert steps == ["__init__", "_start_workers", "_set_local_rank_env", "_monitor_workers", "_stop_workers",
                     "_restart_workers", "_exit_barrier"]


def test_a_look_ends_the_restarts_on_a_final_exit_and_hands_the_heals_its_result_before_the_job_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []
    failed = RunResult(state=WorkerState.FAILED, failures={0: ProcessFailure(0, 11, 2, "")})
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: calls.append("torch") or failed)
    agent = make_agent("keep", final_exits=frozenset({2}))
    agent.job_watch = Watch(calls)  # type: ignore[assignment]
    monkeypatch.setattr(agent.job_watch, "look", lambda group, result: calls.append(agent.heals.last_result))
    assert agent._monitor_workers(agent._worker_group) is failed
    assert calls == ["torch", failed], "torch's look, then the job watch, which finds the heals told"
    assert agent._remaining_restarts == 0, "a restart would meet the same input"
    agent._remaining_restarts = 3
    failed.failures[0].exitcode = 1
    agent._monitor_workers(agent._worker_group)
    assert agent._remaining_restarts == 3, "any other failure restarts as torch would"


def test_a_start_tells_the_job_watch_first_gives_each_worker_the_heals_variables_and_guards_the_stop_signals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []
    envs: list[dict[str, Any]] = []

    def torch_start(self: LocalElasticAgent, group: Any) -> dict[int, Any]:
        calls.append("torch")
        envs.append({"RANK": "0"})
        self._set_local_rank_env(envs[-1], 0, group.spec)
        return {0: 4242}

    monkeypatch.setattr(LocalElasticAgent, "_start_workers", torch_start)
    monkeypatch.setattr(stop_signals, "guard_torch_handlers", lambda: calls.append("guard"))
    agent = make_agent("keep")
    agent.job_watch = Watch(calls)  # type: ignore[assignment]
    monkeypatch.setattr(agent.heals, "worker_env", lambda group: calls.append("heals") or {"HEAL": "1"})
    assert agent._start_workers(agent._worker_group) == {0: 4242}
    assert calls == ["watch: started", "heals", "torch", "guard"]
    assert envs[0]["HEAL"] == "1" and envs[0]["LOCAL_RANK"] == "0" and envs[0]["RANK"] == "0"
    agent._set_local_rank_env(later := {}, 0, agent._worker_group.spec)
    assert "HEAL" not in later, "only the start under way adds them"


def test_a_stop_ends_a_broken_group_first_and_always_tells_the_keeper(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    fails: list[bool] = []

    def torch_stop(self: LocalElasticAgent, group: Any) -> None:
        calls.append("torch")
        if fails:
            raise RuntimeError("stop failed")

    monkeypatch.setattr(LocalElasticAgent, "_stop_workers", torch_stop)
    monkeypatch.setattr(revive_agent, "end_now", lambda group: calls.append("SIGKILL"))
    keeper = SimpleNamespace(workers_stopped=lambda: calls.append("keeper"))
    agent = make_agent(keeper=keeper)
    agent._stop_workers(agent._worker_group)  # before the first look: no job watch yet
    assert calls == ["torch", "keeper"]
    agent.job_watch = Watch(calls, signal.SIGKILL)  # type: ignore[assignment]
    calls.clear()
    fails.append(True)
    with pytest.raises(RuntimeError):
        agent._stop_workers(agent._worker_group)
    assert calls == ["SIGKILL", "torch", "keeper"]
    fails.clear()
    calls.clear()
    make_agent()._stop_workers(agent._worker_group)  # an agent without a keeper: torch's stop alone
    assert calls == ["torch"]


def test_a_restart_heals_in_place_when_it_can_else_takes_torchs_new_round(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds: list[Any] = []
    monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, group: rounds.append(group))
    agent = make_agent("keep")
    healed = [True, False]
    monkeypatch.setattr(agent.heals, "heal", lambda agent_, group: agent_ is agent and healed.pop(0))
    agent._restart_workers(agent._worker_group)
    assert rounds == []
    agent._restart_workers(agent._worker_group)
    assert rounds == [agent._worker_group]
    make_agent()._restart_workers(agent._worker_group)  # without heals: torch's round at once
    assert len(rounds) == 2


@pytest.mark.parametrize("survivors", ["restart", "keep", "train-on"])
def test_the_exit_barrier_counts_the_live_nodes_under_train_on_only(monkeypatch: pytest.MonkeyPatch, survivors: str) -> None:
    barriers: list[str] = []
    monkeypatch.setattr(LocalElasticAgent, "_exit_barrier", lambda self: barriers.append("torch"))
    monkeypatch.setattr(revive_agent.exit_barrier, "wait_for_live_nodes",
                        lambda store, handler, timeout: barriers.append(f"live nodes in {timeout:g} s"))
    make_agent(survivors)._exit_barrier()
    assert barriers == (["live nodes in 300 s"] if survivors == "train-on" else ["torch"])


def test_torchs_stop_signal_handler_is_guarded_once_and_no_other_handler_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR1,SIGUSR2")
    mine = signal.getsignal(signal.SIGUSR2)
    before = signal.signal(signal.SIGUSR1, mp_api._terminate_process_handler)  # as torch's worker start does
    try:
        stop_signals.guard_torch_handlers()
        guarded = signal.getsignal(signal.SIGUSR1)
        assert guarded is not mp_api._terminate_process_handler and guarded.raises_safely  # type: ignore[union-attr]
        stop_signals.guard_torch_handlers()
        assert signal.getsignal(signal.SIGUSR1) is guarded, "not wrapped twice"
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        signal.signal(signal.SIGUSR1, before)


def launch_config() -> LaunchConfig:
    return LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=1, run_id="job", rdzv_backend="test",
                        rdzv_endpoint="", monitor_interval=0.5, logs_specs=DefaultLogsSpecs())


@pytest.fixture
def handler(monkeypatch: pytest.MonkeyPatch) -> Handler:
    made = Handler()
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")  # launch_agent sets it, as torch's does
    monkeypatch.setattr(revive_agent.rendezvous_registry, "get_rendezvous_handler", lambda parameters: made)
    return made


def test_launch_runs_the_agent_as_torch_would_and_shuts_the_rendezvous_down(
    monkeypatch: pytest.MonkeyPatch, handler: Handler
) -> None:
    built: list[ReviveAgent] = []

    def run(self: ReviveAgent, role: str = "default") -> RunResult:
        built.append(self)
        return RunResult(state=WorkerState.SUCCEEDED, return_values={0: "done"})

    monkeypatch.setattr(ReviveAgent, "run", run)
    assert revive_agent.launch_agent(launch_config(), "python", ["-u", "train.py"]) == {0: "done"}
    (agent,) = built
    spec = agent.get_worker_group().spec
    assert spec.rdzv_handler is handler and spec.args == ("-u", "train.py") and handler.shut_down == 1
    assert spec.monitor_interval == revive_agent.TORCH_SLEEP, "the death watch waits the rest of the interval"
    assert agent.death_watch._wait_for == pytest.approx(0.5 - revive_agent.TORCH_SLEEP)
    monkeypatch.setattr(ReviveAgent, "run", lambda self, role="default": RunResult(
        state=WorkerState.FAILED, failures={0: ProcessFailure(0, 11, 1, "")}))
    with pytest.raises(ChildFailedError, match="train.py FAILED"):  # named as torch names it: the script
        revive_agent.launch_agent(launch_config(), sys.executable, ["-u", "train.py"])
    assert handler.shut_down == 2


def test_launch_leaves_the_rendezvous_open_when_the_agent_was_stopped_by_a_signal(
    monkeypatch: pytest.MonkeyPatch, handler: Handler
) -> None:
    def set_aside(self: ReviveAgent, role: str = "default") -> RunResult:
        raise NodeSetAside("node n1 is set aside")

    monkeypatch.setattr(ReviveAgent, "run", set_aside)
    with pytest.raises(NodeSetAside):
        revive_agent.launch_agent(launch_config(), "python", ["train.py"])
    assert handler.shut_down == 0, "the other nodes train on in it"


def test_an_agent_whose_rendezvous_was_closed_on_a_crash_loop_stops_with_that_line(
    monkeypatch: pytest.MonkeyPatch, handler: Handler
) -> None:
    lines: list[str | None] = ["crash loop: worker rank 1 failed 3 times after step 20", None]

    def closed(self: ReviveAgent, role: str = "default") -> RunResult:
        self.job_watch = SimpleNamespace(crash_loop_line=lambda: lines.pop(0))  # type: ignore[assignment]
        raise RendezvousClosedError

    monkeypatch.setattr(ReviveAgent, "run", closed)
    with pytest.raises(CrashLoopStop, match="crash loop: worker rank 1"):
        revive_agent.launch_agent(launch_config(), "python", ["train.py"])
    with pytest.raises(RendezvousClosedError):  # closed, and not on a crash loop
        revive_agent.launch_agent(launch_config(), "python", ["train.py"])
    assert handler.shut_down == 2


def test_a_heal_replaces_the_workers_in_the_next_generation_and_a_round_after_it_counts_from_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    from elastic._agent.launcher import in_place

    store = dist.HashStore()
    monkeypatch.setattr(in_place, "heal_store", lambda s: s)  # a TCP store in a job; any store here
    monkeypatch.setattr(in_place, "address", lambda s: "host:29500")
    heals = in_place.InPlaceHeals({heal_env.SURVIVORS_ENV: "keep"})
    handler = SimpleNamespace(_settings=SimpleNamespace(min_nodes=2), get_run_id=lambda: "run")
    group = SimpleNamespace(store=store, state=WorkerState.FAILED, group_world_size=2, master_addr="host",
                            master_port=29500, spec=SimpleNamespace(rdzv_handler=handler, local_world_size=1),
                            workers=[SimpleNamespace(global_rank=1, world_size=2, id=None)])
    heals.namespace = "run/1/host:29500"  # the round's first start named it
    dist.PrefixStore(heal_env.namespace_prefix(heals.namespace), store).add(heal_env.HEALERS_KEY, 2)
    heals.last_result = RunResult(state=WorkerState.FAILED, failures={1: ProcessFailure(0, 11, 1, "")})
    calls: list[Any] = []
    agent = SimpleNamespace(_stop_workers=lambda g: calls.append("stop"),
                            _start_workers=lambda g: calls.append(heals.worker_env(g)) or {0: 4343})
    assert heals.heal(agent, group)
    assert heals.generation == 1 and group.state == WorkerState.HEALTHY and group.workers[0].id == 4343
    assert calls[0] == "stop" and calls[1][heal_env.HEAL_GENERATION_ENV] == "1"
    assert calls[1][heal_env.HEAL_NAMESPACE_ENV] == "run/1/host:29500"
    group.state = WorkerState.UNHEALTHY  # not a failure: torch's new round, whose heals count from 0
    assert not heals.heal(agent, group)
    assert heals.generation == 0 and heals.namespace is None
