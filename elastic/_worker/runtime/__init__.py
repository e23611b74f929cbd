"""The worker's process: its environment, read once (`worker_env`), its process group and device (`context`),
random streams, DDP/FSDP wrapping, the round store."""
