"""The node side: what runs in torchrun's agent, beside and outliving the workers.

- `launch`: `torchrevive-run` (`python -m elastic._agent.launcher`), torchrun with
  recovery defaults; it takes every torchrun flag.
- `warm_start`: workers forked from a fork server that imported torch once.
- `reaper`: a stopped worker is SIGKILLed instead of waited on for 30 s.
- `proctree`: the processes below an agent or a node, read from /proc.

Nothing here runs inside a training step: a worker imports it only to name
itself (`proctree.WARM_WORKER_NAME`).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """`torchrevive-run`; imported lazily so a worker naming itself loads no launcher code."""
    from elastic._agent.launcher.launch import main as launch_main

    launch_main(argv)
