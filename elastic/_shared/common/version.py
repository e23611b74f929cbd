"""The release of torchrevive (pyproject.toml reads it; checkpoints record it)."""

__version__ = "0.2.0"
