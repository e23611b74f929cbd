"""What every rank agrees on at the same step: the step vote, agreement helpers, preemption, the hang watchdog."""
