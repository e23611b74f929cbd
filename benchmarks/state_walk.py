"""The live state as tensors by key: our walk (elastic/_worker/checkpoint/state.py) / torch.distributed.checkpoint.state_dict.

    python benchmarks/state_walk.py                 # the GPT recipe's model and a ~100M GPT
    python benchmarks/state_walk.py --models recipe --repeats 20

A snapshot takes this walk at every step (on its thread, which shares the
cores and the GIL with the loop), a checkpoint at every save, a restore once.
For each model, after one AdamW step (so the optimizer state exists), side by
side in one process, median of `--repeats`:

- save side: `state.Layout.tensors()` + `Layout.settings()` (every tensor by
  stable key, the optimizer's settings by parameter name) against DCP's
  `get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))`;
- restore side: `state.optimizer_state_dict` + `optimizer.load_state_dict`
  against DCP's `set_optimizer_state_dict` with the flattened state.

Prints each time in ms and the ratio DCP / ours.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))

from gpt_model import GPT, GPTConfig, configure_optimizer  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
)

from elastic._shared.common.cli import OneLineArgumentParser, positive_int  # noqa: E402
from elastic._worker.checkpoint import state as live_state  # noqa: E402

MODELS = {
    "recipe": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "100M": GPTConfig(block_size=256, n_layer=14, n_head=12, n_embd=768),
}


def median_ms(action: Callable[[], object], repeats: int) -> float:
    action()  # warm
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def trained(cfg: GPTConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = configure_optimizer(model, lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(0, 256, (2, cfg.block_size + 1))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    return model, optimizer


def main(argv: list[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="state_walk.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--repeats", type=positive_int, default=30)
    args = p.parse_args(argv)
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    print(HEADER)
    for name in args.models:
        model, optimizer = trained(MODELS[name])
        layout = live_state.Layout(model, optimizer)
        ours = median_ms(lambda: (layout.tensors(), layout.settings()), args.repeats)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp = median_ms(lambda: get_state_dict(model, optimizer, options=options), args.repeats)
            tensors, settings = layout.tensors(), layout.settings()
            ours_load = median_ms(
                lambda: optimizer.load_state_dict(live_state.optimizer_state_dict(model, optimizer, tensors, settings)),
                args.repeats,
            )
            flat = get_optimizer_state_dict(model, optimizer, options=options)
            dcp_load = median_ms(lambda: set_optimizer_state_dict(model, optimizer, flat, options=options), args.repeats)
        print(row(name, "save", ours, dcp))
        print(row(name, "restore", ours_load, dcp_load))
    return 0


HEADER = f"{'model':<8}{'side':<9}{'ours ms':>9}{'DCP ms':>9}{'DCP/ours':>10}"


def row(model: str, side: str, ours_ms: float, dcp_ms: float) -> str:
    """One line of the table: a model's save or restore side, both medians in ms and DCP / ours."""
    return f"{model:<8}{side:<9}{ours_ms:>9.3f}{dcp_ms:>9.3f}{dcp_ms / ours_ms:>10.1f}"


if __name__ == "__main__":
    sys.exit(main())
