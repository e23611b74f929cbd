"""Internal: what both sides share, below both.

- `storage`: the checkpoint format, its one commit, the keeper's address and peer signing;
- `protocol`: contracts between an agent and its workers carried in the environment
  (the heal environment, recovery defaults, the fault hook the chaos tooling fills);
- `slurm`: Slurm's variables, scontrol, the requeue signal;
- `common`: errors, the command-line helpers, threads, slow imports, the version;
- `timings`: every duration the layer waits, polls or gives up after.
"""
