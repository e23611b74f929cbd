"""Run the GPT recipe while recording, per rank, every sample index it trains on.

Used by the exactly-once test: it wraps `ElasticSampler.local_batch` so each
call appends one JSON line (the sampler's position before the step, the rank,
the world size and the indices) to `$SAMPLE_LOG.rank<R>`, then runs
recipes/gpt.py unchanged as `__main__` with the same arguments.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

from elastic.sampler import ElasticSampler

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "gpt.py"
_original = ElasticSampler.local_batch


def recording_local_batch(self: ElasticSampler, rank: int, world_size: int):
    indices = _original(self, rank, world_size)
    record = {
        "epoch": self.state.epoch, "consumed": self.state.consumed, "rank": rank,
        "world_size": world_size, "batch_size": self.batch_size, "indices": indices.tolist(),
    }
    with open(f"{os.environ['SAMPLE_LOG']}.rank{rank}", "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")
    return indices


ElasticSampler.local_batch = recording_local_batch
sys.argv = [str(RECIPE), *sys.argv[1:]]
runpy.run_path(str(RECIPE), run_name="__main__")
