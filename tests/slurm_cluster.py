"""The tests' one-machine Slurm: elastic.chaos.slurm (the benchmarks start it too)."""

from elastic.chaos.slurm import SlurmCluster, SlurmUnavailable

__all__ = ["SlurmCluster", "SlurmUnavailable"]
