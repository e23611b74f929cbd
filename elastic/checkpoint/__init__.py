"""Crash-safe, asynchronous checkpoints of a whole training state (see manager.py).

`python -m elastic.checkpoint inspect DIR` lists and verifies a checkpoint directory;
`load_newest_model_state(DIR)` reads the newest good model weights in one process,
`read_checkpoint(DIR/step_N)` a whole checkpoint (every tensor whole, by key).
"""

from elastic.checkpoint.manager import CheckpointManager
from elastic.checkpoint.reader import load_newest_model_state, read_checkpoint
from elastic.checkpoint.store import CheckpointStore, Manifest
from elastic.errors import CorruptCheckpoint

__all__ = [
    "CheckpointManager", "CheckpointStore", "CorruptCheckpoint", "Manifest", "load_newest_model_state", "read_checkpoint",
]
