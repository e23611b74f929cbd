"""Checkpoint upload and restore throughput to an S3 server: ours against two others, side by side.

    python benchmarks/object_store.py                 # starts a local S3 server (moto), 256 MB of state
    python benchmarks/object_store.py --mb 1024 --repeats 3
    AWS_ENDPOINT_URL=... python benchmarks/object_store.py --bucket NAME   # a store that runs (its bucket)

The same tensors (float32, `--tensors` of them, `--mb` in all) go to one
server three ways, taking turns repeat by repeat so a change of machine speed
hits all alike:

    ours        the runtime's bucket store: the shard streamed up in parallel
                16 MiB parts (multipart upload), tensors.json and trainer.pt,
                then the create-only manifest; restored through parallel
                ranged reads, every block's crc32c checked
    sequential  one PutObject of the same bytes from memory, one GetObject back
                (no checksums, no commit: the floor of a plain client)
    dcp-fsspec  torch.distributed.checkpoint's FsspecWriter/FsspecReader on
                s3fs (what a stock DCP user writes to S3 with)

Prints each one's upload and restore MB/s (median of the repeats) and its
ratio to the sequential one. The local server is a Python process on the
same cores: its figures rank the clients, they are not S3's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name

from elastic._shared.common.cli import OneLineArgumentParser, int_at_least, run_main  # noqa: E402
from elastic._shared.storage import location, sharded  # noqa: E402
from elastic._shared.storage.commit import commit_checkpoint  # noqa: E402
from elastic._shared.storage.object_store.bucket import BucketStore  # noqa: E402
from elastic._shared.storage.object_store.s3 import S3Objects  # noqa: E402
from provenance import write_result  # noqa: E402

SYSTEMS = ("ours", "sequential", "dcp-fsspec")


def make_state(mb: int, count: int) -> dict[str, torch.Tensor]:
    per = max(1, mb * 2**20 // 4 // count)
    generator = torch.Generator().manual_seed(0)
    return {f"model/layer{i}.weight": torch.randn(per, generator=generator) for i in range(count)}


def ours(bucket: str, state: dict[str, torch.Tensor], run: str) -> tuple[float, float]:
    store = BucketStore(location.parse_bucket(f"s3://{bucket}/{run}"), S3Objects(location.parse_bucket(f"s3://{bucket}")),
                        keep=1000)
    started = time.perf_counter()
    stage = store.begin(1, "bench")
    writer = sharded.save_tensors(state, stage, group=None, sink=store.part_sink(stage))
    commit_checkpoint(store, stage, step=1, world_size=1, shard_sizes=writer.file_sizes,
                      tensors_json=writer.tensors_json.encode(), trainer={"sampler": {"epoch": 0, "consumed": 0}},
                      reason="benchmark", run_id=run)
    uploaded = time.perf_counter() - started
    started = time.perf_counter()
    candidate = store.committed()[0]
    manifest = store.read_checked_manifest(candidate)
    store.check_sizes(candidate, manifest)
    targets = {key: torch.empty_like(t) for key, t in state.items()}
    sharded.load_tensors(targets, candidate.path, store.tensor_metadata(candidate, manifest), group=None,
                         source=store.chunk_source(candidate.path))
    restored = time.perf_counter() - started
    assert all(torch.equal(targets[k], state[k]) for k in state), "ours: the restored state differs"
    return uploaded, restored


def sequential(bucket: str, state: dict[str, torch.Tensor], run: str) -> tuple[float, float]:
    client = S3Objects(location.parse_bucket(f"s3://{bucket}"))._s3
    started = time.perf_counter()
    body = b"".join(t.numpy().tobytes() for t in state.values())
    client.put_object(Bucket=bucket, Key=f"{run}/state.bin", Body=body)
    uploaded = time.perf_counter() - started
    started = time.perf_counter()
    data = client.get_object(Bucket=bucket, Key=f"{run}/state.bin")["Body"].read()
    restored = time.perf_counter() - started
    assert data == body, "sequential: the object read back differs"
    return uploaded, restored


def dcp_fsspec(bucket: str, state: dict[str, torch.Tensor], run: str) -> tuple[float, float]:
    import os
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    options = {"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}} if os.environ.get("AWS_ENDPOINT_URL") else {}
    path = f"s3://{bucket}/{run}/dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        started = time.perf_counter()
        dcp.save(state, storage_writer=FsspecWriter(path, **options), no_dist=True)
        uploaded = time.perf_counter() - started
        targets = {key: torch.empty_like(t) for key, t in state.items()}
        started = time.perf_counter()
        dcp.load(targets, storage_reader=FsspecReader(path, **options), no_dist=True)
        restored = time.perf_counter() - started
    assert all(torch.equal(targets[k], state[k]) for k in state), "dcp-fsspec: the restored state differs"
    return uploaded, restored


RUNNERS: dict[str, Callable[[str, dict[str, torch.Tensor], str], tuple[float, float]]] = {
    "ours": ours, "sequential": sequential, "dcp-fsspec": dcp_fsspec,
}


def table(mb: float, results: dict[str, list[tuple[float, float]]]) -> str:
    """The printed table: each system's median upload and restore MB/s and the ratio to `sequential`."""
    rows = ["| system | upload MB/s | restore MB/s | upload vs sequential | restore vs sequential |", "|---|---:|---:|---:|---:|"]
    rates = {name: (mb / statistics.median(u for u, _ in runs), mb / statistics.median(r for _, r in runs))
             for name, runs in results.items()}
    base = rates.get("sequential")
    for name, (up, down) in rates.items():
        ratio = (f"{up / base[0]:.2f}x", f"{down / base[1]:.2f}x") if base else ("", "")
        rows.append(f"| {name} | {up:.0f} | {down:.0f} | {ratio[0]} | {ratio[1]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="benchmarks/object_store.py", description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int_at_least(1), default=256, help="megabytes of state")
    parser.add_argument("--tensors", type=int_at_least(1), default=16)
    parser.add_argument("--repeats", type=int_at_least(1), default=3)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)}")
    parser.add_argument("--bucket", help="a bucket of the store AWS_ENDPOINT_URL names (default: a local server)")
    parser.add_argument("--json", type=Path, help="write the figures and their provenance here (benchmarks/provenance.py)")
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    state = make_state(args.mb, args.tensors)
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    if args.bucket:
        return report(args.bucket, state, mb, systems, args.repeats, args.json)
    import os

    from elastic.chaos.s3_server import S3Server

    with S3Server() as server:
        os.environ.update({k: v for k, v in server.environment().items() if k.startswith("AWS_")})
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        server.create_bucket(bucket)
        return report(bucket, state, mb, systems, args.repeats, args.json)


def report(bucket: str, state: dict[str, torch.Tensor], mb: float, systems: list[str], repeats: int,
           json_path: Path | None = None) -> int:
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for repeat in range(repeats):
        for name in systems:
            results[name].append(RUNNERS[name](bucket, state, f"{name}-{repeat}-{uuid.uuid4().hex[:6]}"))
    print(f"{mb:.0f} MB of float32 state in {len(state)} tensors, {repeats} repeat(s), "
          f"{torch.get_num_threads()} torch threads")
    print(table(mb, results))
    if json_path is not None:
        rates = {name: {"upload_mb_s": mb / statistics.median(u for u, _ in runs),
                        "restore_mb_s": mb / statistics.median(r for _, r in runs), "seconds": runs}
                 for name, runs in results.items()}
        write_result(json_path, "object_store", {"mb": mb, "repeats": repeats, "systems": rates})
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
