"""A real two-agent job with --metrics-port: scraped while it trains, hurt once, then drawn.

One job serves both tests (it is the expensive part): the fixture scrapes both
workers over HTTP during the run, SIGKILLs rank 1's worker, keeps scraping
until the restarted group reports, and lets the job finish.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import sys
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import warm
from prometheus_client.parser import text_string_to_metric_families
from support import (
    REPO,
    TINY_MODEL,
    free_port,
    make_text,
    start_agents,
    torchrun_command,
    wait_all,
    wait_for,
    worker_rank,
)

from elastic._agent.launcher.proctree import descendants
from elastic._worker.observe.events import read_events

pytestmark = pytest.mark.slow

STEPS = 400


@dataclass
class Scrape:
    port: int
    rank: str
    run_id: str
    step: float
    restarts: float
    restored_step: float


@dataclass
class Job:
    events: Path
    workdir: Path
    ports: list[int]
    codes: list[int]
    logs: str
    scrapes: list[Scrape] = field(default_factory=list)


def scrape(port: int) -> Scrape | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None  # between worker groups, or not up yet
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = s
    if "torchrevive_step" not in values:
        return None
    step = values["torchrevive_step"]
    return Scrape(
        port, step.labels["rank"], step.labels["run_id"], step.value,
        values["torchrevive_restarts"].value, values["torchrevive_restored_step"].value,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    workdir = tmp_path_factory.mktemp("metrics-job")
    corpus = workdir / "corpus.txt"
    corpus.write_text(make_text(random.Random(0), 40_000))
    rdzv, ports = free_port(), [free_port(), free_port()]
    events = workdir / "events.jsonl"

    def command(metrics_port: int) -> list[str]:
        cmd = torchrun_command(
            nnodes="1:2", port=rdzv, run_id="metrics", max_restarts=2,
            script_args=[
                "--data", str(corpus), "--max-steps", str(STEPS), "--eval-every", "0", "--events", str(events),
                "--ckpt-dir", str(workdir / "ckpt"), "--ckpt-every", "10", "--metrics-port", str(metrics_port),
                *TINY_MODEL,
            ],
        )
        cmd[cmd.index("torch.distributed.run")] = "elastic._agent.launcher"  # fast recovery, same flags
        return cmd

    # Two agents on one machine share its address: each gets its own base port here
    # (on a cluster every node uses the same one).
    agents = []
    for i, metrics_port in enumerate(ports):
        (workdir / f"a{i}").mkdir()
        agents += start_agents(1, command(metrics_port), workdir / f"a{i}")
    result = Job(events=events, workdir=workdir, ports=ports, codes=[], logs="")
    try:
        def both_stepping(minimum: float) -> bool:
            got = [scrape(p) for p in ports]
            if all(s is not None and s.step >= minimum for s in got):
                result.scrapes += got
                return True
            return False

        # Past the first checkpoint (step 10), so the restarted group resumes from one.
        wait_for(lambda: both_stepping(12), 120, "both workers' metrics to show step >= 12")
        first = max(s.step for s in result.scrapes)
        wait_for(lambda: both_stepping(first + 5), 60, "the step counter to rise")

        victim = wait_for(
            lambda: next((pid for a in agents for pid in descendants(a.pid) if worker_rank(pid) == 1), None),
            30, "rank 1's worker",
        )
        os.kill(victim, signal.SIGKILL)

        def restarted() -> bool:
            # Workers of the new group: they resumed from a checkpoint. (Rank 1's agent counts
            # a failure; rank 0's counts one too unless it saw the rejoining node first.)
            got = [scrape(p) for p in ports]
            if all(s is not None and s.restored_step > 0 for s in got):
                result.scrapes += got
                return True
            return False

        wait_for(restarted, 120, "both workers of the restarted group to serve their metrics")
        result.codes = wait_all(agents, timeout=240)
    except AssertionError as exc:  # a wait timed out: what the agents said is what explains it
        raise AssertionError(f"{exc}\n{agent_logs(workdir)}") from None
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
        result.logs = agent_logs(workdir)
    return result


def agent_logs(workdir: Path) -> str:
    return "\n".join((workdir / f"a{i}" / "agent0.log").read_text(errors="replace")[-3000:] for i in range(2))


def test_both_workers_are_scraped_with_a_rising_step_and_their_ranks(job: Job) -> None:
    assert job.codes == [0, 0], job.logs
    before = [s for s in job.scrapes if s.restored_step == 0]
    after = [s for s in job.scrapes if s.restored_step > 0]
    assert {s.rank for s in before} == {"0", "1"}, "the labels name both ranks"
    assert {s.run_id for s in job.scrapes} == {"metrics"}
    for port in job.ports:
        steps = [s.step for s in before if s.port == port]
        assert steps == sorted(steps) and steps[-1] > steps[0], f"step counter on port {port} did not rise"
    assert {s.port for s in after} == set(job.ports), "each restarted worker serves on its port again"
    assert max(s.restarts for s in after) == 1, "the kill shows in the restart count"
    assert "without a metrics endpoint" not in job.logs, "no port was taken"


def png_text_chunks(data: bytes) -> dict[str, str]:
    chunks, offset = {}, 8
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset:offset + 4]), data[offset + 4:offset + 8]
        body = data[offset + 8:offset + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            chunks[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        offset += 12 + length
    return chunks


def test_the_report_draws_the_run_and_states_the_recovery_the_log_shows(job: Job, tmp_path: Path) -> None:
    assert job.codes == [0, 0], job.logs
    out = tmp_path / "run.png"
    result = warm.run(
        [sys.executable, "-m", "elastic.report", str(job.events), "-o", str(out), "--width", "1200", "--height", "900"],
        cwd=REPO, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1200, 900)

    # The recovery straight from the log: last step before the second group's start,
    # first step after it.
    events = list(read_events(job.events))
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    assert len(starts) >= 2, "the kill restarted the group"
    before = [e for e in events[: starts[1]] if e["event"] == "step"][-1]
    after = next(e for e in events[starts[1]:] if e["event"] == "step")
    expected = after["time"] - before["time"]

    stated = json.loads(png_text_chunks(data)["Recoveries"])
    assert len(stated) == 1 and abs(stated[0] - expected) < 0.001
    assert f"recovered in {expected:.1f} s" in result.stdout
