"""Internal: the agent side, torchrun's agent process on each node.

- `launcher`: `torchrevive-run` (torchrun with recovery defaults), warm starts,
  the snapshot keeper, the reaper, heals in place, Slurm's signals;
- `rendezvous`: the `etcd-v3` rendezvous backend, quick rounds, and the rendezvous state
  checked before torch unpickles it (signed, read by a restricted unpickler);
- `timings`: every duration the side waits, polls or gives up after.

Nothing here imports the worker side (`elastic._worker`); both import `elastic._shared`.
"""
