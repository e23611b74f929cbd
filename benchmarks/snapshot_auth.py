"""What signing snapshot traffic costs: a restore's reads from a peer keeper, and a snapshot's copy to one.

Measured side by side in one run, signing on and off in alternation (pairs), against a real
snapshot keeper in a process of its own:

- restore: `--restore-mb` (default 1024) of one part read the way a restoring rank reads another
  node's part (`keeper_client.get_range`, `part_files.READ_MAX` bytes a request), each range's
  tag checked; and, for scale, the same bytes copied from a local memory buffer;
- snapshot: one part of `--part-mb` (default: the GPT recipe's whole state, 10 MB) PUT to the keeper, as the
  snapshot thread copies a part to the peer node after each snapshot (the loop waits for it
  only if it takes longer than a step; the README's overhead figures measure the loop).

"Off" is this protocol with the signature check and the tags replaced by no-ops (patched here
only), so the difference is the cryptography alone. Prints medians and ratios (off / on).

    python benchmarks/snapshot_auth.py [--restore-mb 1024] [--part-mb 10] [--pairs 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, by plain name

from common import memory_copies, memory_dir  # noqa: E402

from elastic._agent.launcher.keeper import SnapshotKeeper
from elastic._shared.storage import parts, peer_auth
from elastic._shared.storage.chunks import BLOCK, StoredChunk, block_checksums
from elastic._shared.storage.keeper_address import LOCAL
from elastic._shared.storage.parts import PartHeader
from elastic._shared.storage.peer_auth import PeerKey
from elastic._worker.checkpoint import keeper_client
from elastic._worker.checkpoint.part_files import READ_MAX

RUN = "auth-bench"


class _NoTag:
    """A Poly1305 that does nothing: the protocol without its cryptography."""

    def update(self, data: Any) -> None:
        pass

    def finalize(self) -> bytes:
        return b"\0" * peer_auth.TAG_BYTES


def unsigned() -> None:
    """Turn signing off in this process (the benchmark's "off" side)."""
    peer_auth.PeerKey.body_tag = lambda self, nonce, what: _NoTag()  # type: ignore[method-assign]
    peer_auth.RequestVerifier.check = lambda self, method, path, headers: headers.get(peer_auth.NONCE) or "0" * 32  # type: ignore[method-assign]
    peer_auth.check_tag = lambda mac, tag: True  # type: ignore[assignment]


def part_header(data: bytes) -> PartHeader:
    """A header for `data` as one uint8 tensor of rank 0 of a 1-rank job (what the keeper checks)."""
    stem = parts.part_stem(0, "2-abcdef", 0)
    chunk = StoredChunk(stem + parts.DATA_SUFFIX, 0, len(data), "torch.uint8", (len(data),),
                        tuple(block_checksums(memoryview(data), BLOCK)), BLOCK)
    trainer, trainer_crc = parts.encode_trainer({"step": 1})
    return PartHeader(
        run_id=RUN, step=1, rank=0, world_size=1, writer="2-abcdef", slot=0, data_bytes=len(data),
        chunks=[{"fqn": "w", "at": [0], **chunk.to_json()}], tensors={"w": {"dtype": "torch.uint8", "size": [len(data)]}},
        trainer=trainer, trainer_crc32c=trainer_crc, ckpt_dir="/nonexistent", keep=1, created=time.time(),
        extra={"generation": ""},
    )


def keeper_process(secret: bytes, base: str, signed: bool, size: int, ready: Any, stop: Any) -> None:
    if not signed:
        unsigned()
    keeper = SnapshotKeeper("127.0.0.1", key=PeerKey(secret), run_id=RUN, base=Path(base))
    name = parts.part_stem(0, "1-abcdef", 0) + parts.DATA_SUFFIX
    with open(keeper.root / LOCAL / name, "wb") as f:
        block = os.urandom(2**20)
        f.writelines(block for _ in range(size // 2**20))
    keeper.address.note_job(RUN, "", 1)
    ready.put((keeper.url, name))
    stop.wait()
    keeper.close(timeout=5)


@contextmanager
def served_keeper(secret: bytes, base: str, signed: bool, size: int) -> Iterator[tuple[str, str]]:
    """A keeper in a process of its own (`keeper_process`, forked: it needs nothing of this process but its
    imports) with one part of `size` random bytes, while in the block: (its URL, the part's name)."""
    context = mp.get_context("fork")
    ready, stop = context.Queue(), context.Event()
    server = context.Process(target=keeper_process, args=(secret, base, signed, size, ready, stop))
    server.start()
    try:
        yield ready.get(timeout=300)
    finally:
        stop.set()
        server.join(30)


def one_side(signed: bool, secret: bytes, restore: int, part: bytes, base: str) -> dict[str, float]:
    with served_keeper(secret, base, signed, restore) as (url, name):
        key = PeerKey(secret)
        part_url = f"{url}/part/{LOCAL}/{name}"
        started = time.perf_counter()
        for start in range(0, restore, READ_MAX):
            got = keeper_client.get_range(part_url, key, start, min(start + READ_MAX, restore), 60)
            assert len(got) == min(READ_MAX, restore - start)
        restore_s = time.perf_counter() - started
        header = part_header(part)
        started = time.perf_counter()
        keeper_client.push_part(url, key, header.stem, header.to_json(), memoryview(part), 60)
        push_s = time.perf_counter() - started
        return {"restore_s": restore_s, "push_s": push_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restore-mb", type=int, default=1024)
    parser.add_argument("--part-mb", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=5)
    opts = parser.parse_args(argv)
    if opts.restore_mb < 1 or opts.part_mb < 1 or opts.pairs < 1:
        parser.error("--restore-mb, --part-mb and --pairs must be at least 1")
    secret, restore = os.urandom(32), opts.restore_mb * 2**20
    part = os.urandom(opts.part_mb * 2**20)
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="auth-bench-", dir=memory_dir()) as base:
        for pair in range(opts.pairs):
            for signed in ((True, False) if pair % 2 == 0 else (False, True)):
                if not signed:
                    saved = (peer_auth.PeerKey.body_tag, peer_auth.RequestVerifier.check, peer_auth.check_tag)
                    unsigned()
                try:
                    results[signed].append(one_side(signed, secret, restore, part, base))
                finally:
                    if not signed:
                        peer_auth.PeerKey.body_tag, peer_auth.RequestVerifier.check, peer_auth.check_tag = saved  # type: ignore[method-assign]
    copies = memory_copies(restore, 3)
    print("\n".join(report(opts, results, copies)))
    return 0


def report(opts: argparse.Namespace, results: dict[bool, list[dict[str, float]]], copies: list[float]) -> list[str]:
    """The lines printed from each side's seconds per pair (`one_side`'s dicts, signed: True) and the
    memory copies' seconds: medians, GB/s and unsigned / signed."""

    def median(signed: bool, what: str) -> float:
        return statistics.median(r[what] for r in results[signed])

    lines = [f"snapshot traffic, signed vs not ({opts.pairs} pairs, medians):"]
    for what, label, size in (("restore_s", f"restore, {opts.restore_mb} MB from a peer keeper", opts.restore_mb * 2**20),
                              ("push_s", f"snapshot copy to the peer, {opts.part_mb} MB part", opts.part_mb * 2**20)):
        on, off = median(True, what), median(False, what)
        lines.append(f"  {label:<44} signed {on:.3f} s ({size / on / 1e9:.2f} GB/s)   unsigned {off:.3f} s "
                     f"({size / off / 1e9:.2f} GB/s)   unsigned / signed {off / on:.3f}")
    lines.append(f"  for scale: a local memory copy of {opts.restore_mb} MB takes {statistics.median(copies):.3f} s")
    return lines


if __name__ == "__main__":
    sys.exit(main())
