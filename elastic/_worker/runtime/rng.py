"""Random number generator states as tensors and plain types.

A checkpoint loads with `torch.load(weights_only=True)`, which accepts only
tensors, numbers, strings, None and lists/tuples/dicts of them. Python's and
numpy's generator states are tuples holding arrays, so they are converted to
that vocabulary here and back on restore. Nothing else in the runtime
touches generator internals.

Invariants: `set_rng_state(get_rng_state())` leaves every generator (python,
numpy, torch CPU, and the current CUDA device's) exactly where it was; so does
a block under `isolated(device)`, whatever it draws (the same generators: those
a checkpoint carries).
"""

from __future__ import annotations

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
            "internal": torch.tensor(py_internal, dtype=torch.int64),
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
