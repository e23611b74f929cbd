"""Internal: the Hugging Face integration behind `elastic.hf` (transformers and accelerate are imported only here)."""
