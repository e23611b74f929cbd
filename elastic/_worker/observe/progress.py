"""Progress of the main rank: a tqdm bar on a terminal, plain log lines elsewhere.

Files, CI logs and `kubectl logs` get one line every `log_every` steps rather
than carriage-return bar updates; other ranks report nothing.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from tqdm import tqdm

logger = logging.getLogger(__name__)


class Progress:
    def __init__(
        self,
        *,
        total: int,
        initial: int = 0,
        enabled: bool = True,
        log_every: int = 10,
        stream: TextIO | None = None,
        unit: str = "tokens",
    ) -> None:
        """`unit`: what the throughput passed to `update` counts (tokens, images, ...)."""
        self._enabled = enabled
        self._unit = unit
        self._rate_key = "tok_s" if unit == "tokens" else f"{unit}_s"
        self._total = total
        self._log_every = max(1, log_every)
        stream = sys.stdout if stream is None else stream
        self._bar = None
        if enabled and stream.isatty():
            self._bar = tqdm(total=total, initial=initial, file=stream, unit="step", dynamic_ncols=True)

    def update(self, step: int, *, loss: float, tokens_per_s: float) -> None:
        """Report that `step` (1-based count of completed steps) finished; `tokens_per_s`
        is the throughput in the constructor's `unit` per second."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix({"loss": f"{loss:.4f}", self._rate_key: f"{tokens_per_s:,.0f}"}, refresh=False)
            self._bar.update(step - self._bar.n)
        elif step % self._log_every == 0 or step == self._total:
            logger.info("step %d/%d loss %.4f %.0f %s/s", step, self._total, loss, tokens_per_s, self._unit)

    def write(self, message: str) -> None:
        """A message that does not tear the bar."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            logger.info("%s", message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
