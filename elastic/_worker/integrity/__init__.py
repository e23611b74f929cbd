"""Silent corruption and numeric faults: caught, named and undone (replica checks, rollback, the numeric guard)."""
