"""Helpers every part uses: errors (one line and an exit status each), command-line helpers, threads, the version."""
