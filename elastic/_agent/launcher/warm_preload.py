"""The fork server's preload: the modules imported in order, CUDA checked after each.

Run in multiprocessing's fork server (warm_start.py imports this there and keeps
the report for the agent's probe); a test may run it anywhere.

Invariant: a forked worker must find CUDA untouched, so the first module after
whose import torch initialised CUDA (its lazy init, or a device count or init
call into the driver) ends the preload and is named in the report; the agent
then starts every worker cold. The watch on torch's entry points is taken off
again when the preload ends, whatever happened.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PreloadReport:
    """What the fork server's preload did (made there, read by the agent)."""

    pid: int
    """The process that imported the modules: the fork server, or the report is not its own."""
    cuda_by: str | None = None
    """The module after whose import CUDA was initialised; the preload stopped there."""
    failed: tuple[tuple[str, str], ...] = ()
    """(module, `Error: message`) for each module whose import raised; skipped, as multiprocessing does."""


def import_preload(modules: Sequence[str]) -> PreloadReport:
    """Import `modules` in order, as the fork server does, checking CUDA after each.

    torch comes first when a module of it is named, so that CUDA calls made by
    the others' imports are seen. The first module after whose import CUDA is
    initialised ends the preload (`cuda_by`); one whose import raises is noted
    and skipped. Run in the fork server; a test may run it anywhere.
    """
    failed: list[tuple[str, str]] = []
    names = list(modules)
    if any(name == "torch" or name.startswith("torch.") for name in names):
        names.insert(0, "torch")
    watch = _CudaWatch()
    try:
        for name in dict.fromkeys(names):
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - one line for the agent; the worker's own import will say more
                message = str(exc).strip().splitlines()
                failed.append((name, f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__))
            watch.install()
            if watch.initialised():
                return PreloadReport(pid=os.getpid(), cuda_by=name, failed=tuple(failed))
        return PreloadReport(pid=os.getpid(), failed=tuple(failed))
    finally:
        watch.remove()


class _CudaWatch:
    """Whether this process initialised CUDA through torch: its lazy init (after which a
    forked child fails with "Cannot re-initialize CUDA in forked subprocess"), or a
    device count or init call into the driver (cuInit: a forked child's CUDA is broken)."""

    _ENTRY_POINTS = ("_cuda_getDeviceCount", "_cuda_init")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        """Watch torch's entry points into the driver, once torch is imported."""
        native = getattr(sys.modules.get("torch"), "_C", None)
        if native is None or self._originals:
            return
        for name in self._ENTRY_POINTS:
            original = getattr(native, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(native, name, self._watched(name, original))

    def _watched(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if name != "_cuda_getDeviceCount" or result > 0:  # no driver or no GPU: nothing to break
                self.calls.append(name)
            return result

        return call

    def initialised(self) -> bool:
        cuda = sys.modules.get("torch.cuda")
        return bool(self.calls) or (cuda is not None and bool(cuda.is_initialized()))

    def remove(self) -> None:
        native = getattr(sys.modules.get("torch"), "_C", None)
        for name, original in self._originals.items():
            setattr(native, name, original)
        self._originals.clear()
