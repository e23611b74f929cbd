"""Random number generator states as tensors and plain types.

A checkpoint loads with `torch.load(weights_only=True)`, which accepts only
tensors, numbers, strings, None and lists/tuples/dicts of them. Python's and
numpy's generator states are tuples holding arrays, so they are converted to
that vocabulary here and back on restore. Nothing else in the runtime
touches generator internals.

Invariants: `set_rng_state(get_rng_state())` leaves every generator (python,
numpy, torch CPU, and the current CUDA device's) exactly where it was; so does
a block under `isolated(device)`, whatever it draws (the same generators: those
a checkpoint carries). `seed_step` makes what a step draws a function of (seed, step, rank) alone, never of
the process's history: a worker that replaces a dead one under `--survivors keep`
draws, at the step it trains first, exactly what the dead one would have drawn.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def get_rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generator states; CUDA's only when `device` is a GPU."""
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(py_version),
            "internal": torch.from_numpy(np.asarray(py_internal, dtype=np.int64)),  # 3x torch.tensor's speed
            "gauss_next": py_gauss,
        },
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Put every generator back where `get_rng_state` found it."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def seed_all(seed: int, device: torch.device) -> None:
    """Seed python, numpy, torch and CUDA generators from one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of rank `rank`'s random streams in step `step` (a 63-bit hash: no two keys collide in practice)."""
    digest = hashlib.blake2b(f"{seed}/step/{step}/rank/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_step(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Seed every generator for training step `step` as rank `rank` (see the module docstring).

    Why every step and not once: a process's streams otherwise carry its whole history, which a
    replacement cannot have (its predecessor's state died with it; the survivors hold their own),
    so after a heal in place its dropout masks would differ from an uninterrupted run's from then
    on. Seeded per step, every rank's draws in a step follow from its place alone; a replica
    check's retry that trains another rank's block seeds as that rank."""
    seed_all(step_seed(seed, step, rank), device)


@contextmanager
def isolated(device: torch.device) -> Iterator[None]:
    """Fork every generator a checkpoint carries (python, numpy, torch CPU, `device`'s CUDA one) for the
    block and put each back after it, an exception included: work between steps (an evaluation with
    dropout, a shuffled test loader, sampling) never moves the training's random stream. A DataLoader
    draws its workers' seeds and its shuffle from torch's CPU generator, so a loader's draws are forked too."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
