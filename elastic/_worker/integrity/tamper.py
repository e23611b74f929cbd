"""The faults the fault plugin asks for that change numbers, not processes (ELASTIC_FAULT do=flip, do=nan).

The plugin (elastic.chaos.faults) only says which fault is due
(`FaultHook.tamper`); the library makes it, here, since only the worker holds
the model:

- `flip_one_bit`: one bit of one parameter of this rank flips, as a bit in a
  GPU's memory would: bit `BIT` (a low bit of the mantissa of a float32, of
  the fraction of a bf16/fp16) of the first element of the first parameter.
  Training goes on without a sign of it; only the replicas' digests differ.
- `NanLoss`: a forward hook that makes the model's outputs (and so the loss
  of the step it is armed for) NaN on this rank.
"""

from __future__ import annotations

from typing import Any

import torch

BIT = 3


def flip_one_bit(model: torch.nn.Module) -> str:
    """Flip bit `BIT` of the first element of the first parameter with any element; its name."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.numel() == 0:
                continue
            flat = local.detach().view(-1)[:1]
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            view = flat.view(bits)
            view ^= torch.tensor(1 << BIT, dtype=bits, device=view.device)
            return name
    raise ValueError("the model has no parameter to flip a bit of")


def _nan_like(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output * float("nan") if output.is_floating_point() else output
    if isinstance(output, tuple):
        return tuple(_nan_like(o) for o in output)
    if isinstance(output, list):
        return [_nan_like(o) for o in output]
    if isinstance(output, dict):
        return {k: _nan_like(v) for k, v in output.items()}
    return output


class NanLoss:
    """A forward hook on the model that turns its outputs NaN while armed (one forward at a time)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.armed = False
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not self.armed or not module.training:
            return None
        self.armed = False
        return _nan_like(output)

    def remove(self) -> None:
        self._handle.remove()
