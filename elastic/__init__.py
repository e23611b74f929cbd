"""torchrevive: a fault-tolerant elastic training runtime for PyTorch.

The library (`elastic`) holds the pieces recipes compose: the worker runtime
(`elastic.runtime`), the elastic sampler (`elastic.sampler`), the event log
(`elastic.events`) and replica checks (`elastic.replicas`). It never imports a
recipe: dependencies point recipes -> elastic -> torch.
"""

__version__ = "0.1.0"
