"""Chaos: faults injected into workers (`faults`) and a harness that runs elastic
jobs and hurts them on a schedule (`harness`, `python -m elastic.chaos`)."""

from elastic.chaos.faults import (
    ACTIONS,
    ENV_VAR,
    FAULT_POINTS,
    Fault,
    FaultInjector,
    parse_faults,
)

__all__ = ["ACTIONS", "ENV_VAR", "FAULT_POINTS", "Fault", "FaultInjector", "parse_faults"]
