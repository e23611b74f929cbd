"""Contracts between an agent and its workers that travel in the environment: heals, recovery defaults, faults."""
