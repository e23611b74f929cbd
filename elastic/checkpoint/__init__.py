"""Crash-safe, asynchronous checkpoints of a whole training state (see manager.py).

`python -m elastic.checkpoint inspect DIR` lists and verifies a checkpoint directory.
"""

from elastic.checkpoint.manager import CheckpointManager
from elastic.checkpoint.store import CheckpointStore, CorruptCheckpoint, Manifest

__all__ = ["CheckpointManager", "CheckpointStore", "CorruptCheckpoint", "Manifest"]
