"""What the Hugging Face integration refuses at start, each in one line naming the feature and the way out.

A feature is refused when, under the integration, it would resume inexactly
(another data order, another step count) or run a path nothing here has
tested; never silently. Each check takes plain values (`TrainingArguments`
fields, the data set, the accelerator), so the refusals are tested without
starting a job. The raised `UsageError` becomes one stderr line and exit 2
(`elastic._worker.hf.exits`).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

from elastic._shared.common.errors import UsageError

TRAINER = "elastic.hf.Trainer"
ACCELERATED = "elastic._worker.hf.start_accelerated"


def _value(setting: Any) -> Any:
    """An enum setting of TrainingArguments (IntervalStrategy.STEPS) as its plain value ("steps")."""
    return getattr(setting, "value", setting)


def check_dataset(dataset: Any, who: str) -> None:
    """A map-style data set with a length: the elastic sampler picks samples by index."""
    if dataset is None:
        raise UsageError(f"{who} needs train_dataset: the elastic sampler picks its samples by index")
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        raise UsageError(
            f"{who}: train_dataset is an iterable data set ({type(dataset).__name__}), which has no index to resume "
            "at exactly; give a map-style one (a datasets.Dataset, or a torch Dataset with __len__ and __getitem__)"
        )
    if len(dataset) == 0:
        raise UsageError(f"{who}: train_dataset is empty")


def check_training_arguments(args: Any) -> None:
    """The `TrainingArguments` the Trainer integration keeps exact; the first one it cannot, refused."""
    if args.max_steps is None or args.max_steps <= 0:
        raise UsageError(
            f"{TRAINER} needs TrainingArguments(max_steps=N): an epoch's step count changes with the world size, "
            "so an elastic run is counted in steps (num_train_epochs is not used)"
        )
    if getattr(args, "deepspeed", None):
        raise UsageError(
            f"{TRAINER}: DeepSpeed (TrainingArguments.deepspeed) is not supported yet: its ZeRO engine state has not "
            "been tested with the runtime's commit and restore (it needs a GPU); train without --deepspeed (DDP), "
            "or shard a plain PyTorch loop with elastic.Run.fsdp"
        )
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_config", None) and args.fsdp_config.get("fsdp_version"):
        raise UsageError(
            f"{TRAINER}: TrainingArguments.fsdp is not supported: the Trainer integration trains with DDP; "
            "to shard, use accelerate with elastic._worker.hf.start_accelerated, or elastic.Run.fsdp"
        )
    if getattr(args, "n_gpu", 1) > 1:
        raise UsageError(
            f"{TRAINER}: this process sees {args.n_gpu} GPUs and would use DataParallel; start one process per GPU "
            "(torchrevive-run --nproc-per-node=N)"
        )
    if args.fp16 or getattr(args, "fp16_full_eval", False):
        raise UsageError(
            f"{TRAINER}: fp16 (a grad-scaled half precision) is not supported yet; use bf16=True, which needs no grad "
            "scaler"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")  # transformers < 5: group_by_length=True
    if getattr(args, "group_by_length", False):
        strategy = "group_by_length"
    if strategy != "random":
        raise UsageError(
            f"{TRAINER}: train_sampling_strategy={strategy!r} is not supported: the elastic sampler draws each "
            "epoch's seeded random order for the whole job, the one order that resumes exactly at any world size; "
            "use the default, 'random'"
        )
    if getattr(args, "torch_compile", False):
        raise UsageError(
            f"{TRAINER}: torch_compile=True is not applied by the elastic Trainer (accelerate compiles in a prepare "
            "step it does not take); pass a model you compiled yourself: the run saves the module underneath"
        )
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        raise UsageError(
            f"{TRAINER}: activation checkpointing is not switched on by the elastic Trainer; call "
            "model.gradient_checkpointing_enable() before making the Trainer, and leave the argument unset"
        )
    unapplied = {  # setting -> (is it set, why it is refused)
        "neftune_noise_alpha": (getattr(args, "neftune_noise_alpha", None) is not None, "its noise hooks are not applied"),
        "use_liger_kernel": (bool(getattr(args, "use_liger_kernel", False)), "its kernels are not patched in"),
        "eval_on_start": (bool(getattr(args, "eval_on_start", False)), "evaluate before train() yourself"),
        "include_num_input_tokens_seen": (
            _value(getattr(args, "include_num_input_tokens_seen", "no")) not in ("no", False),
            "tokens are not counted (the run's events count samples)",
        ),
        "data_seed": (getattr(args, "data_seed", None) is not None, "the data order comes from seed alone"),
        "parallelism_config": (getattr(args, "parallelism_config", None) is not None, "the integration trains DDP"),
        "enable_jit_checkpoint": (
            bool(getattr(args, "enable_jit_checkpoint", False)), "SIGTERM already commits a checkpoint through the run"
        ),
    }
    for name, (is_set, why) in unapplied.items():
        if is_set:
            raise UsageError(f"{TRAINER}: {name} is not supported: {why}; leave it unset")
    if args.auto_find_batch_size:
        raise UsageError(
            f"{TRAINER}: auto_find_batch_size=True changes the batch size after an out-of-memory error, which moves "
            "every later sample; set per_device_train_batch_size yourself"
        )
    if args.load_best_model_at_end:
        raise UsageError(
            f"{TRAINER}: load_best_model_at_end=True needs the Trainer's own checkpoint-N folders, which the elastic "
            "Trainer does not write; evaluate the final model, or keep the best one from the eval events yourself"
        )
    for name in ("save_strategy", "eval_strategy", "logging_strategy"):
        setting = _value(getattr(args, name))
        if setting not in ("steps", "no"):
            raise UsageError(
                f"{TRAINER}: {name}={setting!r} is not supported: an elastic run counts steps, not epochs "
                f"(the steps of an epoch change with the world size); use {name}='steps'"
            )


def check_train_call(resume_from_checkpoint: Any, trial: Any) -> None:
    """`Trainer.train`'s own arguments."""
    if isinstance(resume_from_checkpoint, str):
        raise UsageError(
            f"{TRAINER}: resume_from_checkpoint={resume_from_checkpoint!r}: the elastic Trainer restores the newest "
            "good checkpoint of its own by itself; drop the argument (to start from a Hugging Face checkpoint's "
            "weights, load the model with from_pretrained)"
        )
    if trial is not None:
        raise UsageError(f"{TRAINER}: hyperparameter search (trial=...) is not supported; run one job per trial")


def check_accelerator(accelerator: Any, scheduler: Any) -> None:
    """An `Accelerator` whose steps are the run's steps: one optimizer step and one scheduler step each."""
    kind = str(_value(accelerator.distributed_type)).upper()
    if kind in ("DEEPSPEED", "MEGATRON_LM", "XLA"):
        raise UsageError(
            f"{ACCELERATED}: accelerate's {kind} mode is not supported (its engine keeps state the runtime does not "
            "save); use DDP or FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2))"
        )
    if accelerator.gradient_accumulation_steps > 1:
        raise UsageError(
            f"{ACCELERATED}: Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}): "
            "each batch of run.batches() is one optimizer step; give start_accelerated the whole step's batch "
            "size and split it into micro-batches in the loop"
        )
    if getattr(accelerator, "scaler", None) is not None:
        raise UsageError(f"{ACCELERATED}: fp16 with a grad scaler is not supported yet; use mixed_precision='bf16'")
    if type(scheduler).__name__ == "AcceleratedScheduler" and scheduler.step_with_optimizer and not scheduler.split_batches:
        raise UsageError(
            f"{ACCELERATED}: a scheduler from accelerator.prepare() steps once per process at each step, so its "
            "schedule would change with the world size; pass the scheduler unprepared (step it once per step), or "
            "make the Accelerator with step_scheduler_with_optimizer=False"
        )
