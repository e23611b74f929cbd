"""The worker's process: its process group and device (`context`), random streams, DDP/FSDP wrapping, the round store."""
