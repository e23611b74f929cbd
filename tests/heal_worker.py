"""A DDP training script on the raw pieces of `elastic._worker.survivors` (regroup, ddp_rebind,
catch_up): what test_regroup.py checks.

Under torchrevive-run with TORCHREVIVE_SURVIVORS=keep (or a stand-in that sets the
same variables) it heals in place: a step whose gradient all-reduce failed is void,
the worker waits for its agent's heal, forms the next group and shares its state
with the replacement (`share_state`: this script's own catch-up, a broadcast over the
new group, as a user of the raw pieces would write it; `elastic.Run` catches up through
its checkpoint manager's live restore instead). Without a heal point it joins by torch's env:// and exits 1
on a void step: its agent then restarts every worker through a new round.

    python heal_worker.py STEPS KILL_AT KILLED_RANK REPORT

The worker of KILLED_RANK SIGKILLs itself once per job (REPORT.killed records when)
while its peers wait on it inside the all-reduce of step KILL_AT + 1. Every process
appends {rank, pid, generation, restart} to REPORT.started; rank 0 appends each
completed step's time to REPORT.steps; each worker that ends appends its record
(pid, steps trained, heals, weights) to REPORT.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic._shared.common.errors import EnvironmentConfigError, first_line
from elastic._shared.protocol import heal_env
from elastic._worker.survivors import catch_up, ddp_rebind, regroup

TIMEOUT = timedelta(seconds=60)


def append(path: str, record: dict) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def share_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, src: int) -> None:
    """Make every member's parameters, buffers and per-parameter optimizer state equal to
    rank `src`'s (collectives). A member whose optimizer has no state yet (a replacement)
    makes it first (`prepare_optimizer_state`) when the source has some; when the source has
    none (no step taken, or an optimizer without state), only the model is sent. What is not
    a tensor there (learning rates in `param_groups`, a scheduler) is the script's to carry."""
    try:
        source_has_state = torch.tensor([int(bool(optimizer.state))], dtype=torch.int64)
        dist.broadcast(source_has_state, src)
        if source_has_state.item() and not optimizer.state:
            prepare_optimizer_state(optimizer)
        for tensor in state_tensors(model, optimizer if source_has_state.item() else None):
            dist.broadcast(tensor, src)
    except RuntimeError as error:
        raise regroup.GroupBroken(
            f"the new group broke while rank {src} shared its state: {first_line(error)}") from None


def prepare_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its per-parameter state, so that `share_state` can fill it:
    one step on zero gradients makes the state (its keys and shapes are the optimizer's
    own), then the parameters are put back (weight decay moved them)."""
    saved = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    originals = [p.detach().clone() for p, _ in saved]
    for p, _ in saved:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for (p, grad), original in zip(saved, originals):
            p.copy_(original)
            p.grad = grad


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor a member must hold equal to the source's, in an order all members share."""
    tensors = [t.data for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    for group in optimizer.param_groups if optimizer is not None else ():
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            tensors += [state[key] for key in sorted(state) if isinstance(state[key], torch.Tensor)]
    return tensors


def main() -> int:
    try:
        steps, kill_at, killed_rank = (int(n) for n in sys.argv[1:4])
        report = sys.argv[4]
        os.environ["RANK"]  # noqa: B018 - a worker of a job
    except (ValueError, IndexError, KeyError):
        print("usage: python heal_worker.py STEPS KILL_AT KILLED_RANK REPORT, as a worker of a job "
              "(tests/integration/test_regroup.py starts it)", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        point = regroup.heal_point(os.environ)
    except (regroup.RegroupError, EnvironmentConfigError) as error:
        print(f"heal_worker: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    generation = point.generation if point is not None else 0
    replacement = generation > 0
    append(report + ".started", {"rank": rank, "pid": os.getpid(), "generation": generation,
                                 "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    try:
        if point is None:
            dist.init_process_group("gloo", timeout=TIMEOUT)
        else:
            regroup.rejoin(point.store, generation=generation, rank=rank, world_size=world, timeout=TIMEOUT)
    except regroup.RegroupError as error:
        print(error, flush=True)
        return heal_env.HEAL_FAILED_EXIT
    # A replacement's DDP makes no collective of its own: its state comes from a survivor below.
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, init_sync=not replacement)
    guard = ddp_rebind.StepGuard()
    guard.attach(ddp)
    guard.guard(optimizer)

    def take_newest_state(completed: int) -> int:
        agreed = catch_up.agree(completed)
        share_state(model, optimizer, src=agreed.source)
        return agreed.most

    completed, trained, heals = 0, [], 0
    if replacement:
        try:
            completed = take_newest_state(0)
        except regroup.RegroupError as error:
            print(error, flush=True)
            return heal_env.HEAL_FAILED_EXIT
    while completed < steps:
        batch = torch.Generator().manual_seed(1000 * completed + rank)  # this rank's batch of this step
        x, y = torch.randn(8, 16, generator=batch), torch.randn(8, 4, generator=batch)
        if rank == killed_rank and completed == kill_at and not os.path.exists(report + ".killed"):
            time.sleep(0.5)  # the peers are inside this step's all-reduce, waiting on this rank
            with open(report + ".killed", "w") as killed:
                killed.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if guard.void:
            print(f"rank {rank}: step {completed + 1} is void ({guard.error})", flush=True)
            if point is None:
                return 1  # no heal point: the agent restarts every worker
            regroup.leave(ddp)  # the peers still inside the broken all-reduce fail now, not at its timeout
            try:
                generation = regroup.next_generation(point, after=generation, timeout=TIMEOUT)
                regroup.rejoin(point.store, generation=generation, rank=rank, world_size=world, timeout=TIMEOUT)
                ddp_rebind.rebind(ddp, guard)
                guard.clear()
                completed, heals = take_newest_state(completed), heals + 1
            except regroup.RegroupError as error:
                print(error, flush=True)
                return heal_env.HEAL_FAILED_EXIT
            continue
        completed += 1
        trained.append(completed)
        if rank == 0:
            append(report + ".steps", {"step": completed, "t": time.time()})
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    append(report, {"rank": rank, "pid": os.getpid(), "trained": trained, "regrouped": heals, "digest": digest,
                    "final": [p.detach().tolist() for p in model.parameters()]})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
