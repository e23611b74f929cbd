"""One rank of tests/integration/test_heal_collectives.py: the collectives each step runs around two heals.

    python tests/heal_steps_rank.py RANK PORT OUT

Two ranks train a DDP model of three 512-wide layers (two gradient buckets once DDP laid them
out), then heal twice as the survivors do (elastic._worker.survivors.regroup, .ddp_rebind): each time both
leave the group and form the next generation's; rank 1 builds a fresh DDP there, as a replacement
does, rank 0 rebinds its own. The first heal stops there (torch's behaviour for a fresh reducer);
the second also settles the buckets (`rebind(reverse=True)` and `settle_buckets`, as
`Healing.settle_buckets` does). torch's Flight Recorder (on gloo it records each collective, with
no times) gives the collectives of every step and of each heal; OUT gets them as JSON, with a
digest of the final parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
from datetime import timedelta

os.environ["TORCH_FR_BUFFER_SIZE"] = "4000"  # before the first group: the recorder's size is read then

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._C._distributed_c10d import _dump_fr_trace  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from elastic._worker.survivors import ddp_rebind, regroup  # noqa: E402

WORLD = 2


def recorded() -> list[list]:
    """Every collective recorded so far: [name, input sizes]."""
    return [[e["profiling_name"], e["input_sizes"]] for e in pickle.loads(_dump_fr_trace())["entries"]]


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=regroup.heal_group_store(store, 0), rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 512))
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    segments: list[tuple[str, int]] = []  # (what, collectives recorded by its end)

    def step(name: str) -> None:
        loss = ddp(torch.randn(8, 512, generator=data)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        segments.append((name, len(recorded())))

    def heal(generation: int, settle: bool) -> None:
        nonlocal ddp
        regroup.leave(ddp)
        regroup.rejoin(store, generation=generation, rank=rank, world_size=WORLD)
        if rank == 1:  # the replacement's DDP, built on the new group without DDP's first broadcast
            ddp = DistributedDataParallel(model, init_sync=False)
        else:
            ddp_rebind.rebind(ddp)
        if settle:
            ddp_rebind.rebind(ddp, reverse=True)
            ddp_rebind.settle_buckets(ddp)
        segments.append((f"heal {generation}", len(recorded())))

    segments.append(("start", len(recorded())))
    for n in range(1, 4):
        step(f"step {n}")
    heal(1, settle=False)
    for n in range(4, 7):
        step(f"step {n}")
    heal(2, settle=True)
    for n in range(7, 10):
        step(f"step {n}")
    entries = recorded()
    by_segment = {name: entries[begin:end] for (_, begin), (name, end) in zip(segments, segments[1:])}
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    with open(out, "w") as f:
        json.dump({"segments": by_segment, "digest": digest}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
