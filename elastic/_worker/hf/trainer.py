"""`elastic.hf.Trainer`: `transformers.Trainer` whose `train()` runs on `elastic.Run`.

A script changes its import (`from elastic.hf import Trainer`) and sets
`max_steps`; everything else of `TrainingArguments` keeps its meaning or is
refused at start in one line (`elastic._worker.hf.checks`). What `train()` does:

- joins the run (the process group accelerate made under torchrun is
  adopted), wraps the model in DDP, builds the optimizer and scheduler
  with the Trainer's own `create_optimizer` / `create_scheduler`, and restores
  the newest good checkpoint: model, optimizer, scheduler, data position, step
  and every rank's RNG (`resume_from_checkpoint` is not needed);
- trains `max_steps` steps, each of `per_device_train_batch_size *
  gradient_accumulation_steps` samples per rank taken from the elastic
  sampler (`run.batch_sampler()` drives the train loader: exact at any world
  size, no batch skipping), split into the micro-batches that go through the
  Trainer's `training_step` (so a `compute_loss` or `training_step` override
  still applies);
- checkpoints every `save_steps` (`--ckpt-every`), asynchronously, into
  `output_dir/elastic-checkpoints` unless the `RunConfig` given says where;
  in-memory snapshots under torchrevive-run;
- keeps the Trainer's callbacks (`on_step_end`, `on_log`, ...), its `log`
  and `log_history`, and evaluates every `eval_steps` inside `run.pause()`;
  the run's progress line replaces the Trainer's progress bar;
- ends with the final checkpoint and the replica check; `save_model()`
  then writes a normal Hugging Face model folder. A SIGTERM commits the step
  on every rank and exits 143; refusals exit 2; failing storage exits 75.

Invariant: one run step is one optimizer step, and `state.global_step` is the
run's step (restored ones included).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import time
from contextlib import nullcontext
from typing import Any

import torch
import transformers
from torch.utils.data import DataLoader
from transformers.trainer_callback import (
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerState,
)
from transformers.trainer_utils import TrainOutput

from elastic._shared.common.errors import UsageError
from elastic._worker.config import RunConfig
from elastic._worker.hf.checks import (
    check_dataset,
    check_train_call,
    check_training_arguments,
)
from elastic._worker.hf.exits import exit_on_elastic_error
from elastic._worker.hf.group import join_before_accelerate
from elastic._worker.run.run import Run
from elastic._worker.runtime.collectives import all_reduce_mean

logger = logging.getLogger(__name__)

# Importing the Trainer joins the job's group, before the script's TrainingArguments make accelerate do
# it over torchrun's shared store (elastic._worker.hf.group says why).
with exit_on_elastic_error():  # a bad launch environment: one line, not a traceback from an import
    join_before_accelerate()

try:  # transformers >= 5
    from transformers.optimization import GreedyLR

    METRIC_SCHEDULERS: tuple[type, ...] = (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)
except ImportError:
    METRIC_SCHEDULERS = (torch.optim.lr_scheduler.ReduceLROnPlateau,)

CHECKPOINT_FOLDER = "elastic-checkpoints"
"""Where checkpoints go inside `output_dir` when the `RunConfig` names no `ckpt_dir`."""


def run_config_for(args: transformers.TrainingArguments, given: RunConfig | None = None) -> RunConfig:
    """The run's settings: `given` (or the defaults), with what `TrainingArguments` says of them.

    seed <- `seed`; checkpoint interval <- `save_steps` (0 for save_strategy "no": only the final
    checkpoint and the one on SIGTERM); checkpoint folder <- `given.ckpt_dir`, else
    `output_dir/elastic-checkpoints`; `use_cpu` -> device cpu.
    """
    base = given or RunConfig()
    if getattr(args.save_strategy, "value", args.save_strategy) == "no":
        every = 0
    else:
        every = math.ceil(args.max_steps * args.save_steps) if args.save_steps < 1 else int(args.save_steps)
    return dataclasses.replace(
        base, seed=args.seed, ckpt_every=every,
        ckpt_dir=base.ckpt_dir or os.path.join(args.output_dir, CHECKPOINT_FOLDER),
        device="cpu" if args.use_cpu else base.device,
    )


def split_batch(batch: Any, parts: int) -> list[Any]:
    """A step's collated batch as `parts` micro-batches along the first dimension (a dict of tensors or lists)."""
    if parts == 1:
        return [batch]
    if not hasattr(batch, "items"):
        raise UsageError(
            f"elastic.hf.Trainer: gradient_accumulation_steps > 1 splits each step's batch into micro-batches, "
            f"which needs a dict-like batch; the data collator gave a {type(batch).__name__}"
        )
    pieces: list[dict[str, Any]] = [{} for _ in range(parts)]
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            chunks: Any = torch.tensor_split(value, parts)
        elif isinstance(value, list):
            size = math.ceil(len(value) / parts)
            chunks = [value[i * size : (i + 1) * size] for i in range(parts)]
        else:  # a scalar shared by the whole batch
            chunks = [value] * parts
        for piece, chunk in zip(pieces, chunks):
            piece[key] = chunk
    return pieces


class _LossTally:
    """The steps' losses (and the last gradient norm) on the device, read only when the Trainer logs: one host
    sync per log, the loss averaged over ranks as the stock Trainer logs it (a collective: every rank logs at
    the same steps)."""

    def __init__(self, device: torch.device, step: int) -> None:
        self.pending = torch.zeros((), device=device)
        self.grad_norm: torch.Tensor | None = None
        self.last_read = step
        self.total = 0.0
        """Sum of the losses read so far (for the mean loss of this train() call)."""

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        self.pending += loss
        self.grad_norm = grad_norm

    def read(self, step: int, run: Run) -> tuple[float, float | None]:
        """(The mean loss over ranks of the steps since the last read, up to `step`; the last gradient norm.)"""
        steps = max(1, step - self.last_read)
        value = all_reduce_mean(self.pending).item() if run.distributed else self.pending.item()
        self.total += value
        self.pending.zero_()
        self.last_read = step
        return value / steps, None if self.grad_norm is None else self.grad_norm.item()


class _RunLogLines(TrainerCallback):
    """The Trainer's log dicts as lines on rank 0's console that do not tear the run's progress line."""

    def __init__(self) -> None:
        self.run: Run | None = None

    def on_log(self, args: Any, state: TrainerState, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.run is None or not logs or not state.is_world_process_zero:
            return
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}
        self.run.print(str(shown))


class Trainer(transformers.Trainer):
    """`transformers.Trainer` made fault-tolerant; see the module docstring.

    Takes every argument of `transformers.Trainer`, and `run_config`: the
    runtime's settings (`elastic.RunConfig`, e.g. from a recipe's flags) for
    what `TrainingArguments` does not say (events, metrics, timeouts, ...).
    """

    def __init__(self, *args: Any, run_config: RunConfig | None = None, **kwargs: Any) -> None:
        given = inspect.signature(transformers.Trainer.__init__).bind(self, *args, **kwargs).arguments
        with exit_on_elastic_error():
            if given.get("args") is not None:  # refused before the Trainer builds its accelerator
                check_training_arguments(given["args"])
            check_dataset(given.get("train_dataset"), "elastic.hf.Trainer")
            if given.get("model_init") is not None:
                raise UsageError("elastic.hf.Trainer: model_init is not supported; pass the model")
        super().__init__(*args, **kwargs)
        with exit_on_elastic_error():
            check_training_arguments(self.args)  # the defaults the Trainer filled in
            if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # e.g. from `accelerate launch`'s environment
                raise UsageError(
                    "elastic.hf.Trainer: accelerate is set up for DeepSpeed or FSDP (ACCELERATE_USE_DEEPSPEED / "
                    "ACCELERATE_USE_FSDP); the Trainer integration trains with DDP: launch without them"
                )
            self.run_config = run_config_for(self.args, run_config)
        self._log_lines = _RunLogLines()
        self.run: Run | None = None

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train `max_steps` steps from the newest good checkpoint (or from the start); see the module docstring."""
        with exit_on_elastic_error():
            check_train_call(resume_from_checkpoint, trial)
            # While training, the run's progress line replaces the Trainer's bar (its logs print beside it).
            consoles = [cb for cb in self.callback_handler.callbacks if isinstance(cb, (ProgressCallback, PrinterCallback))]
            for callback in consoles:
                self.remove_callback(callback)
            self.add_callback(self._log_lines)
            try:
                with Run(self.run_config) as run:
                    self.run = self._log_lines.run = run
                    return self._train_on(run, ignore_keys_for_eval)
            finally:
                self.run = self._log_lines.run = None
                self.is_in_train = False
                self.remove_callback(self._log_lines)
                for callback in consoles:
                    self.add_callback(callback)

    # -- the loop ------------------------------------------------------------------

    def _train_on(self, run: Run, ignore_keys_for_eval: list[str] | None) -> TrainOutput:
        args = self.args
        self.is_in_train = True
        model, loader = self._prepare(run)
        started, first_step = time.time(), run.step
        tally = _LossTally(run.device, run.step)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        evaluate_now = False
        for batch in run.batches(loader, max_steps=args.max_steps):
            if evaluate_now:  # at the step boundary: the run's step, data position and state agree here
                self._evaluate_paused(run, ignore_keys_for_eval)
                evaluate_now = False
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            step_loss, grad_norm, learning_rate = self._optimizer_step(model, batch, run.device)
            run.log(step_loss)
            tally.add(step_loss, grad_norm)
            self.state.global_step = run.step + 1  # the run counts the step when the next batch is asked for
            self.state.epoch = run.epochs_done + self._step_samples * run.world_size / len(self.train_dataset)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if self.control.should_log:
                loss, norm = tally.read(self.state.global_step, run)
                logs = {"loss": loss, "learning_rate": learning_rate}
                self.log(logs if norm is None else {**logs, "grad_norm": norm})
                self.control.should_log = False
            evaluate_now = evaluate_now or self.control.should_evaluate
            self.control.should_evaluate = False
            self.control.should_save = False  # the run checkpoints every save_steps by itself
            if self.control.should_training_stop and run.step + 1 < args.max_steps:
                break  # a callback stops the run: this step counts (its optimizer step is done)
        if evaluate_now:
            self._evaluate_paused(run, ignore_keys_for_eval)
        tally.read(run.step, run)
        summary = run.finish()
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        steps = run.step - first_step
        metrics = {
            "train_runtime": round(time.time() - started, 4),
            "train_steps_per_second": round(summary["steps_per_s"], 3) if steps else 0.0,
            "train_loss": tally.total / steps if steps else math.nan,
        }
        self.log(dict(metrics))
        return TrainOutput(run.step, metrics["train_loss"], metrics)

    def _evaluate_paused(self, run: Run, ignore_keys: list[str] | None) -> None:
        """The Trainer's evaluation between steps: the watchdog does not count it, a SIGTERM waits for its end
        and then commits the step; a plateau scheduler steps on its metric, and the best metric is kept."""
        with run.pause():
            metrics = self._evaluate(None, ignore_keys)
        if self.args.metric_for_best_model:
            self._determine_best_metric(metrics, None)

    def _prepare(self, run: Run) -> tuple[torch.nn.Module, DataLoader]:
        """DDP, the Trainer's optimizer and scheduler, the restore, the TrainerState and the step loader."""
        args = self.args
        if next(self.model.parameters()).device != run.device:
            self.model.to(run.device)
        ddp_options = {"find_unused_parameters": bool(args.ddp_find_unused_parameters)} if run.distributed else {}
        model = self.model_wrapped = run.ddp(self.model, **ddp_options)
        self.create_optimizer()  # each keeps what Trainer(optimizers=(...)) was given
        self.create_scheduler(num_training_steps=args.max_steps, optimizer=self.optimizer)
        self._step_samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        run.start(model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler, data=self.train_dataset,
                  batch_size=self._step_samples)
        self._start_state(run)
        loader = self._step_loader(run)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = loader
        return model, loader

    def _optimizer_step(
        self, model: torch.nn.Module, batch: Any, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """One step: its micro-batches through `training_step` (gradients reduced on the last), clipping,
        the optimizer and the scheduler. Returns (the step's loss, the gradient norm, the learning rate used);
        the tensors stay on the device."""
        args = self.args
        micro_batches = split_batch(batch, args.gradient_accumulation_steps)
        # As the stock loop: the loss is normalised by the label tokens of the whole step (on every rank, when
        # average_tokens_across_devices), else divided by the micro-batches.
        num_items = self._get_num_items_in_batch(micro_batches, device)
        self.current_gradient_accumulation_steps = len(micro_batches)
        step_loss = torch.zeros((), device=device)
        for i, inputs in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
                with self.accelerator.autocast():
                    step_loss += self.training_step(model, inputs, num_items).detach()
        grad_norm = None
        if args.max_grad_norm and args.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).detach()
        self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
        self.optimizer.step()
        self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
        learning_rate = self._get_learning_rate()
        if not isinstance(self.lr_scheduler, METRIC_SCHEDULERS):  # those step on the evaluation's metric (_evaluate)
            self.lr_scheduler.step()
        model.zero_grad(set_to_none=True)
        return step_loss, grad_norm, learning_rate

    def _start_state(self, run: Run) -> None:
        """The TrainerState of a run at `run.step` (restored steps included)."""
        self.state = TrainerState(
            stateful_callbacks=[
                cb for cb in self.callback_handler.callbacks + [self.control]
                if isinstance(cb, transformers.trainer_callback.ExportableState)
            ]
        )
        self.state.train_batch_size = self.args.per_device_train_batch_size
        self.state.compute_steps(self.args, self.args.max_steps)
        self.state.init_training_references(self, self.args.max_steps, 1, None)
        self.state.global_step = run.step
        self.state.epoch = run.epochs_done

    def _step_loader(self, run: Run) -> DataLoader:
        """The train loader, driven by the run's step sampler: this rank's samples of each step, once."""
        dataset = self.train_dataset
        collator = self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="training")
            else:
                collator = self._get_collator_with_removed_columns(collator, description="training")
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        args = self.args
        workers = args.dataloader_num_workers
        return DataLoader(
            dataset, batch_sampler=run.batch_sampler(), collate_fn=collator, num_workers=workers,
            pin_memory=args.dataloader_pin_memory and run.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            **({"prefetch_factor": args.dataloader_prefetch_factor} if workers > 0 else {}),
        )
