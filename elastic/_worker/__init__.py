"""Internal: the worker side, everything that runs inside a training process.

Layers, top to bottom (pyproject.toml's import-linter contracts keep them):

- `hf`: the Hugging Face `Trainer` and `accelerate` integration, on top of `Run`;
- `run`: `Run` (the front door's object) composed of its parts, the step loop,
  the per-group parts (vote, checkpoint manager), the LR schedules;
- `survivors` beside `checkpoint`: a group that changes in place (a plug-in of
  `Run`), and the state manager;
- `observe`: the event log, metrics, progress, the per-step report and costs, replica digests;
- `control`: what every rank agrees on (the step vote, agreement), preemption, the hang watchdog;
- `data`: the elastic sampler and the loader glue;
- `runtime`: the process group, the device, random streams, DDP/FSDP wrapping;
- `config`: `RunConfig`, the worker's settings and their flags;
- `timings`: every duration the side waits, polls or gives up after.

Nothing here imports the agent side (`elastic._agent`); both import `elastic._shared`.
Scripts import only `elastic` and `elastic.hf`.
"""
