"""Crash-safe, asynchronous checkpoints of a whole training state (see manager.py).

`python -m elastic.checkpoint inspect DIR` lists and verifies a checkpoint directory;
`load_newest_model_state(DIR)` reads the newest good model weights in one process.
"""

from elastic.checkpoint.manager import CheckpointManager
from elastic.checkpoint.reader import load_newest_model_state
from elastic.checkpoint.store import CheckpointStore, CorruptCheckpoint, Manifest

__all__ = ["CheckpointManager", "CheckpointStore", "CorruptCheckpoint", "Manifest", "load_newest_model_state"]
