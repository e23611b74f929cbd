"""Slurm: what a job step tells its tasks (`step`), in Slurm's own notations (`hostlist`), and what
a task asks of the controller (`control`: a node's address, a requeue).

Shared by the worker side (a task started by `srun python script.py` learns its rank here) and the
agent side (`torchrevive-run --rdzv-endpoint=slurm` learns the rendezvous endpoint here), so it
imports neither. docs/slurm.md is the user's side of it.
"""
