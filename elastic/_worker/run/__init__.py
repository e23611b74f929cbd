"""`Run` and the parts it is composed of: the step loop, the per-group parts, LR schedules."""
