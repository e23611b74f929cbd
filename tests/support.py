"""Helpers shared by the tests: ports, text, torchrun agents, checkpoints, metrics."""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from elastic._agent.launcher.proctree import children as children_of  # noqa: F401 - re-exported
from elastic._agent.launcher.proctree import worker_rank  # noqa: F401 - re-exported
from elastic._shared.protocol.round_identity import ROUND_ENV
from elastic._shared.protocol.worker_notes import NOTES_ENV
from elastic._worker.checkpoint import read_checkpoint
from elastic._worker.data.sampler import ElasticSampler
from elastic._worker.observe.metrics import PREFIX, TrainingMetrics
from elastic._worker.runtime.context import WorkerContext
from elastic.chaos.netns import free_port  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parent.parent
GPT_RECIPE = REPO / "recipes" / "gpt.py"
CIFAR_RECIPE = REPO / "recipes" / "cifar.py"

# A GPT small enough that a CPU step takes milliseconds, with dropout on.
TINY_MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8"]

WORDS = (
    "the quick brown fox jumps over a lazy dog while every worker keeps its step and "
    "no sample is lost when the job restarts from the last checkpoint on another node"
).split()


def make_text(rng: random.Random, size: int) -> str:
    """Sentences of common words: structured enough that a model's loss falls fast."""
    out: list[str] = []
    length = 0
    while length < size:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + ".\n"
        out.append(sentence)
        length += len(sentence)
    return "".join(out)[:size]


CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cifar10(root: Path, *, train: int = 320, test: int = 80, seed: int = 0) -> Path:
    """A CIFAR-10 folder, `root`/cifar-10-batches-py/, in the release's exact python format
    (pickled dicts: uint8 `data` rows of 3072 pixels, plane by plane, and `labels`;
    five training batches, a test batch, batches.meta), holding `train` + `test`
    images a small CNN learns in a few epochs: each class has its own colour, plus noise.
    Returns `root`."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(30, 226, size=(10, 3))
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)

    def images(count: int) -> tuple[np.ndarray, list[int]]:
        labels = rng.integers(0, 10, size=count)
        pixels = colours[labels][:, :, None] + rng.normal(0, 40, size=(count, 3, 1024))
        return np.clip(pixels, 0, 255).astype(np.uint8).reshape(count, 3072), [int(label) for label in labels]

    def write(name: str, content: dict[str, Any]) -> None:
        # The release's files are protocol-2 pickles naming numpy.core.multiarray (numpy 2 says numpy._core).
        data = pickle.dumps(content, protocol=2).replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
        (folder / name).write_bytes(data)

    for number, size in enumerate(np.array_split(np.arange(train), 5), 1):
        data, labels = images(len(size))
        write(f"data_batch_{number}", {
            "batch_label": f"training batch {number} of 5", "labels": labels, "data": data,
            "filenames": [f"train_{number}_{i}.png" for i in range(len(labels))],
        })
    data, labels = images(test)
    write("test_batch", {
        "batch_label": "testing batch 1 of 1", "labels": labels, "data": data,
        "filenames": [f"test_{i}.png" for i in range(len(labels))],
    })
    write("batches.meta", {"num_cases_per_batch": -(-train // 5), "label_names": CIFAR_CLASSES, "num_vis": 3072})
    return root


INHERITED_NEVER = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", ROUND_ENV, NOTES_ENV})
"""Variables a child job never takes from the test process: torchrun's, and the round identity an agent's handler
publishes in its own environment (a test that ran handlers in this process left it: a later plain-torchrun job's
workers then sealed their worker store in that stale round, read the dead round's gloo addresses as current, and
hung or were refused, in the full suite only)."""


def worker_env(**extra: str) -> dict[str, str]:
    """The environment for a child job: no inherited torchrun variables, quiet threads."""
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_NEVER}
    # Each rendezvous round gets a fresh worker store: with torchrun's shared store a node
    # joining after the first round times out (see elastic/_agent/launcher/launch.py).
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, **extra)
    return env


def torchrun_command(
    *,
    nnodes: str,
    port: int,
    run_id: str,
    script_args: Sequence[str],
    script: Path | str = GPT_RECIPE,
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    rdzv_conf: str = "join_timeout=60,last_call_timeout=3,close_timeout=5",
    backend: str = "c10d",
    endpoint: str | None = None,
) -> list[str]:
    """One torchrun agent of a job on loopback, running the GPT recipe; the rendezvous
    is c10d on `port` unless `backend` and `endpoint` say otherwise (etcd-v3)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={backend}",
        f"--rdzv-endpoint={endpoint or f'127.0.0.1:{port}'}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={rdzv_conf}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        "--local-addr=127.0.0.1",
        str(script),
        *script_args,
    ]


def standalone_command(
    nproc: int, script_args: Sequence[str], *, script: Path | str = GPT_RECIPE, max_restarts: int = 0,
    record_samples: bool = False, launcher: str = "torch.distributed.run",
) -> list[str]:
    """A one-node torchrun job of `nproc` workers (its own c10d store on a free port);
    `record_samples` runs the script under `elastic.chaos.samples` (set ELASTIC_SAMPLE_LOG);
    `launcher` is stock torchrun or ours (`elastic._agent.launcher`)."""
    wrapper = ["-m", "elastic.chaos.samples"] if record_samples else []
    return [
        sys.executable, "-m", launcher, "--standalone",
        f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "--monitor-interval=0.5",
        *wrapper, str(script), *script_args,
    ]


def run_recipe(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The GPT recipe as one plain `python` process (forked warm: tests/warm.py)."""
    import warm

    return warm.run([sys.executable, str(GPT_RECIPE), *args], timeout=timeout, env=env or worker_env(), cwd=REPO)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll until `condition()` is truthy; return its value or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def flat_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a nested state (dicts, lists), with its path."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from flat_tensors(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from flat_tensors(value, f"{prefix}/{i}")


def fingerprint(directory: Path) -> dict[str, str]:
    """sha256 of every file below `directory`: equal fingerprints mean nothing was touched."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*")) if p.is_file()
    }


def checkpoints_fingerprint(directory: Path) -> dict[str, str]:
    """`fingerprint` of a checkpoint directory without writer.json: the claim every job's rank 0
    writes there when it starts (restore), before anything else; it is no checkpoint data."""
    return {name: digest for name, digest in fingerprint(directory).items() if name != "writer.json"}


def start_agents(
    count: int, command: list[str], log_dir: Path, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Start `count` identical agents, each logging to its own file (`env`: theirs, else `worker_env()`);
    forked warm (tests/warm.py): what they start is started as in production."""
    import warm

    procs = []
    for i in range(count):
        with open(log_dir / f"agent{i}.log", "wb") as log:
            proc = warm.popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or worker_env(), cwd=REPO)
        proc.log_path = log_dir / f"agent{i}.log"  # for wait_all's message if the job hangs
        procs.append(proc)
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit codes of every agent; kills the rest if one overruns `timeout`, and then fails
    with the tail of each agent's log (a hang is otherwise a bare TimeoutExpired)."""
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        tails = [
            f"--- {p.log_path.name} ---\n" + p.log_path.read_text(errors="replace")[-6000:]
            for p in procs if getattr(p, "log_path", None) is not None and p.log_path.exists()
        ]
        if not tails:
            raise
        raise AssertionError(f"agents still running after {timeout} s\n" + "\n".join(tails)) from None
    finally:
        stop_all(procs)
    return codes


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process still running, and reap it."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def logs(directory: Path, pattern: str = "*.log") -> str:
    """The last 3000 characters of each log in `directory`, for a failing assertion's message."""
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(directory.glob(pattern)))


def steps_seen(events: Path) -> int:
    """The highest step in an event log (0 before the first)."""
    from elastic._worker.observe.events import read_events

    if not events.exists():
        return 0
    return max((e["step"] for e in read_events(events) if e["event"] == "step"), default=0)


def kill_worker_after(agents: list[subprocess.Popen], events: Path, step: int, *, rank: int = 1) -> None:
    """SIGKILL the worker of `rank` below `agents` once the event log reaches `step`
    (on any failure here, the agents are killed too)."""
    import signal

    try:
        wait_for(lambda: steps_seen(events) >= step, 120, f"step {step}", interval=0.005)
        victim = next(pid for agent in agents for pid in children_of(agent.pid) if worker_rank(pid) == rank)
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        stop_all(agents)
        raise


def checkpoint_tensors(ckpt_dir: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of the checkpoint of `step`, verified, by part: "model" (state dict keys),
    "optimizer" (`<parameter name>/<state name>`) and "trainer" (RNG states and the rest, by path)."""
    _, tensors, trainer = read_checkpoint(ckpt_dir / f"step_{step:08d}")
    parts: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}}
    for key, tensor in tensors.items():
        prefix, _, name = key.partition("/")
        parts[{"model": "model", "optim": "optimizer"}[prefix]][name] = tensor
    parts["trainer"] = dict(flat_tensors(trainer))
    return parts


def assert_same_tensors(want: dict[str, dict[str, torch.Tensor]], got: dict[str, dict[str, torch.Tensor]], why: str) -> None:
    """Bit-identical states, file by file, tensor by tensor."""
    for name in want:
        assert want[name].keys() == got[name].keys(), f"{name}: other tensors {why}"
        different = [key for key in want[name] if not torch.equal(want[name][key], got[name][key])]
        assert not different, f"{name}: {len(different)} tensors differ {why}, e.g. {different[:3]}"


SEED_ENV = "TORCHREVIVE_TEST_SEED"


def seeded_rng(what: str) -> random.Random:
    """A random.Random for a test's random choice (`what`), seeded from $TORCHREVIVE_TEST_SEED
    or, unset, from a fresh random seed; prints the seed (pytest shows it with a failure),
    so the failing draw comes back with TORCHREVIVE_TEST_SEED=<seed>."""
    given = os.environ.get(SEED_ENV, "").strip()
    seed = int(given) if given else random.SystemRandom().randrange(2**32)
    print(f"{what}: seed {seed} ({'from' if given else 'reproduce with'} {SEED_ENV}={seed})", flush=True)
    return random.Random(seed)


# -- metrics -------------------------------------------------------------------------


def context(rank: int = 1, local_rank: int = 0, restarts: int = 2) -> WorkerContext:
    return WorkerContext(
        rank=rank, local_rank=local_rank, world_size=4, local_world_size=2, restart_count=restarts,
        run_id="job7", device=torch.device("cpu"), backend="gloo",
    )


def samples(metrics: TrainingMetrics) -> dict[str, float]:
    """name{labels} -> value, for this worker's torchrevive_* series."""
    found = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.startswith(PREFIX):
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("rank", "run_id"))
                found[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return found


# -- data ------------------------------------------------------------------------------


class Jittered(Dataset):
    """Sample i is i plus noise from all three global generators: what an augmentation does."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        noise = torch.rand(()).item() + random.random() + float(np.random.rand())
        return torch.tensor([float(index), noise], dtype=torch.float64)


def replay(sampler: ElasticSampler, rank: int, world_size: int, steps: int) -> list[list[tuple[int, int]]]:
    """What the loop sees: local_batch, then advance; keys carry the epoch of their stream position."""
    out = []
    for _ in range(steps):
        epoch, consumed = sampler.state.epoch, sampler.state.consumed
        local = sampler.local_batch(rank, world_size).tolist()
        first = consumed + rank * sampler.batch_size
        out.append([(epoch + (first + j) // sampler.num_samples, i) for j, i in enumerate(local)])
        sampler.advance(world_size)
    return out


def start_keeper(base: Path, *, run_id: str = "local", host: str = "127.0.0.1") -> Any:
    """A snapshot keeper for run `run_id` on `host`, as torchrevive-run starts one: its secret in a
    file (mode 0600) that its `address.environ()` names, for the workers to sign with."""
    from elastic._agent.launcher.keeper import SnapshotKeeper
    from elastic._shared.storage.peer_auth import PeerKey

    base.mkdir(parents=True, exist_ok=True)
    secret_file = base / "secret"
    if not secret_file.exists():
        secret_file.touch(mode=0o600)
        secret_file.write_text(os.urandom(32).hex())
    return SnapshotKeeper(host, key=PeerKey.from_file(secret_file), run_id=run_id, base=base, secret_file=secret_file)


def keeper_request(
    url: str, key: Any, method: str, path: str, *, head: bytes = b"", data: bytes = b"",
    headers: dict[str, str] | None = None, sign: bool = True,
) -> tuple[int, bytes]:
    """One request to a snapshot keeper as a worker makes it (signed with `key`, its body
    `head + data` and their tag; a GET answer's tag checked and removed): (status, body).
    `sign=False` sends it unsigned, as a stranger would."""
    import http.client
    from urllib.parse import urlsplit

    from elastic._shared.storage import peer_auth

    parsed = urlsplit(url)
    body = head + data
    extra = dict(headers or {})
    if method == "PUT":
        body += b"\0" * peer_auth.TAG_BYTES
        extra.setdefault("X-Header-Bytes", str(len(head)))
    if sign:
        signed = key.sign(method, path, receiver=parsed.netloc, content_length=len(body) if method == "PUT" else 0,
                          header_bytes=int(extra["X-Header-Bytes"]) if "X-Header-Bytes" in extra else None)
        extra.update(signed)
        if method == "PUT":
            tag = key.body_tag(signed[peer_auth.NONCE], peer_auth.put_what(path))
            tag.update(head + data)
            body = head + data + tag.finalize()
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=10)
    try:
        conn.request(method, path, body=body if method == "PUT" else None, headers=extra)
        response = conn.getresponse()
        status, answer = response.status, response.read()
        if sign and method == "GET" and status in (200, 206):
            got, tag_bytes = answer[: -peer_auth.TAG_BYTES], answer[-peer_auth.TAG_BYTES :]
            size = int(response.headers["Content-Range"].rsplit("/", 1)[1]) if status == 206 else len(got)
            start = int(response.headers["Content-Range"].split()[1].split("-")[0]) if status == 206 else 0
            tag = key.body_tag(extra[peer_auth.NONCE], peer_auth.response_what(path, status, start, start + len(got), size))
            tag.update(got)
            assert peer_auth.check_tag(tag, tag_bytes), "the keeper's answer fails its tag"
            answer = got
        return status, answer
    finally:
        conn.close()


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def healing_job_args(corpus: Path, steps: int, eval_every: int = 0) -> list[str]:
    """The GPT recipe's arguments in `run_healing_job` (but its checkpoints and events): tiny, with the
    recipe's dropout (0.1): a heal in place must end bit-identical with the random numbers a step draws
    too (a replacement draws what its predecessor would have: elastic._worker.runtime.rng.seed_step)."""
    return [
        "--data", str(corpus), "--max-steps", str(steps), "--lr", "3e-3", "--dropout", "0.1",
        "--eval-every", str(eval_every), "--eval-batches", "1", "--sample-tokens", "0", *TINY_MODEL,
    ]


def run_healing_job(
    tmp_path: Path, corpus: Path, agents: int, *, survivors: str, fault: str, steps: int, nnodes: str,
    ckpt_every: int, sample_log: Path | None = None, nproc_per_node: int = 1, eval_every: int = 0,
    **extra_env: str,
) -> tuple[list[dict[str, Any]], list[str]]:
    """The GPT recipe under torchrevive-run on `agents` agents of one worker each, with
    TORCHREVIVE_SURVIVORS=`survivors` and ELASTIC_FAULT=`fault` (and under the sample audit when
    `sample_log` is given); every agent must exit 0. Its events and each agent's log."""
    from elastic._shared.protocol.heal_env import SURVIVORS_ENV
    from elastic._worker.observe.events import read_events
    from elastic.chaos.samples import LOG_ENV

    tmp_path.mkdir(parents=True, exist_ok=True)
    events = tmp_path / "events.jsonl"
    command = torchrun_command(
        nnodes=nnodes, port=free_port(), run_id=tmp_path.name, max_restarts=3, nproc_per_node=nproc_per_node,
        script_args=[
            *healing_job_args(corpus, steps, eval_every),
            "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", str(ckpt_every), "--events", str(events),
        ],
    )
    command[2] = "elastic._agent.launcher"  # torchrevive-run, not torchrun
    if sample_log is not None:
        recipe = command.index(str(GPT_RECIPE))
        command[recipe:recipe] = ["-m", "elastic.chaos.samples"]
        extra_env[LOG_ENV] = str(sample_log)
    env = worker_env(PYTHONPATH=str(REPO), **{SURVIVORS_ENV: survivors}, ELASTIC_FAULT=fault, **extra_env)
    procs = start_agents(agents, command, tmp_path, env=env)
    codes = wait_all(procs, timeout=300)
    logs = [(tmp_path / f"agent{i}.log").read_text(errors="replace") for i in range(agents)]
    assert codes == [0] * agents, "\n".join(log[-4000:] for log in logs)
    return list(read_events(events)), logs


def workers_started(logs: list[str]) -> dict[int, int]:
    """How many worker processes each start rank had: one "worker ready" line each, under the
    rank torchrun gave it (the log line's prefix)."""
    started: dict[int, int] = {}
    for log in logs:
        for line in log.splitlines():
            if "elastic._worker.runtime.context: worker ready:" in line:
                rank = int(line.split("[rank")[1].split("]")[0])
                started[rank] = started.get(rank, 0) + 1
    return started
