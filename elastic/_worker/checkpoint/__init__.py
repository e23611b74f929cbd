"""The state manager: crash-safe asynchronous checkpoints and in-memory snapshots of a whole training state.

`CheckpointManager` (manager.py) is what the front door uses; its module
docstring maps the pipeline's parts. Tools read checkpoints without a job:
`python -m elastic.checkpoint inspect DIR` lists and verifies a directory,
`load_newest_model_state(DIR)` reads the newest good model weights in one
process, `read_checkpoint(DIR/step_N)` a whole checkpoint (every tensor whole,
by key). The on-disk format and its commit live in elastic._shared.storage.
"""

from elastic._shared.common.errors import CorruptCheckpoint
from elastic._shared.storage.directory import CheckpointStore
from elastic._shared.storage.manifest import Manifest
from elastic._worker.checkpoint.manager import CheckpointManager
from elastic._worker.checkpoint.reader import load_newest_model_state, read_checkpoint

__all__ = [
    "CheckpointManager", "CheckpointStore", "CorruptCheckpoint", "Manifest", "load_newest_model_state", "read_checkpoint",
]
