"""PlanCallback: the plan is a contract. At train start the live run is read back from what the Trainer, accelerate
and the model really built and compared with the plan; any difference stops the run before its first step.

Checked: world size (and that a multi-rank launch is not training separate one-process copies), strategy (from
accelerate's state: a silently dropped FSDP on CPU reads ``ddp``), mixed precision, activation checkpointing (on the
model or inside FSDP's units), micro-batch and accumulation, tp / cp / sp, FSDP wrap classes, the optimizer that
really steps (unwrapped from accelerate's and DeepSpeed's wrappers), and the sequence length of arguments that
truncate to one (TRL's ``max_length``).
:func:`check_launch` (also run by :func:`hf_dist.callbacks.attach` without a plan) refuses the separate copies.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from transformers import TrainerCallback

from hf_dist.configs.config_class import SEQ_FIELD
from hf_dist.configs.optimizer import optimizer_of_optim
from hf_dist.planning.layout import REGISTRY
from hf_dist.planning.wrap import fsdp_wrap_classes
from hf_dist.runtime import dist as _dist

logger = logging.getLogger(__name__)


class PlanMismatchError(RuntimeError):
    """The run the Trainer built is not the run the plan describes."""


def launched_world_size() -> int:
    """Ranks the launcher started (``WORLD_SIZE``, or the initialised process group)."""
    return max(int(os.environ.get("WORLD_SIZE", "1") or 1), _dist.world_size())


def check_launch(args: Any) -> None:
    """Refuse a launch of several ranks that the Trainer trains as one process each: every rank would train its own
    copy into the same ``output_dir`` (on a machine without CUDA, unless the arguments ask for CPU ranks)."""
    launched, trained = launched_world_size(), int(getattr(args, "world_size", 1) or 1)
    if launched > 1 and trained == 1:
        raise PlanMismatchError(
            f"{launched} processes were launched (WORLD_SIZE={launched}) but the Trainer trains each as a single "
            f"process: they would train {launched} separate copies into {getattr(args, 'output_dir', 'output_dir')}.\n"
            "Without CUDA, accelerate joins the ranks only on CPU ranks: for DDP pass use_cpu=True to "
            "TrainingArguments (hf_dist.auto_args adds it to a DDP or FSDP plan launched on CPU ranks), or launch "
            "with ACCELERATE_USE_CPU=1, e.g.\n"
            "  ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train.py\n"
            "FSDP2 and DeepSpeed on CPU ranks (tests and CPU development only) need "
            "hf_dist.auto_args(model, ..., engine_on_cpu=True): FSDP2 is turned on for CPU ranks, and DeepSpeed gets "
            "the kwargs of hf_dist.runtime.cpu_fsdp.cpu_deepspeed_training_kwargs() (the recipes' --fsdp_on_cpu / "
            "--deepspeed_on_cpu)."
        )


def checkpointing_on(model: Any) -> bool:
    """Whether the model checkpoints activations: transformers' flag, or accelerate's FSDP2 checkpoint wrappers."""
    if model is None:
        return False
    inner = getattr(model, "get_base_model", lambda: model)()  # PEFT
    # transformers >= 5.x names it is_activation_checkpointing (the old name warns); 5.0 has only the old one
    flag = next(
        (f for f in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(inner), f)), ""
    )
    if flag and getattr(inner, flag):
        return True
    return any(type(m).__name__ == "CheckpointWrapper" for m in model.modules())


def live_setup(args: Any, model: Any = None, optimizer: Any = None) -> dict[str, Any]:
    """What the Trainer really runs, read from accelerate's state, the arguments, the model and the optimizer."""
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    sizes = _dist.parallel_sizes(getattr(args, "parallelism_config", None), _dist.deepspeed_config(args))
    return {
        "strategy": _dist.live_strategy(args),
        "world_size": int(getattr(args, "world_size", 1) or 1),
        "mixed_precision": precision,
        "wrap_classes": _dist.live_wrap_classes(),
        "micro_batch_size": getattr(args, "per_device_train_batch_size", None),
        "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
        "activation_checkpointing": checkpointing_on(model) if model is not None else None,
        "optimizer": running_optimizer(optimizer, args),
        "max_length": _max_length(args),
        **{f"{name}_size": size for name, size in sizes.items()},
    }


def running_optimizer(optimizer: Any, args: Any = None) -> str | None:
    """The planned optimizer name (``adamw``, ``adamw_8bit``, ``sgd``) of what steps, else its class name.

    Read from the optimizer object the Trainer built (accelerate's and DeepSpeed's wrappers unwrapped: DeepSpeed with
    offload may have swapped in ``DeepSpeedCPUAdam``); before one exists, from ``args.optim``; None without either."""
    if optimizer is None:
        optim = getattr(args, "optim", None)
        return None if optim is None else optimizer_of_optim(optim) or str(getattr(optim, "value", optim))
    while getattr(optimizer, "optimizer", None) is not None and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer  # AcceleratedOptimizer, DeepSpeed's ZeRO / BF16 optimizers
    name = type(optimizer).__name__
    if type(optimizer).__module__.startswith("bitsandbytes"):
        bits = getattr(optimizer, "optim_bits", None) or getattr(getattr(optimizer, "args", None), "optim_bits", 32)
        return "adamw_8bit" if "Adam" in name and bits == 8 else name
    return _OPTIMIZER_CLASSES.get(name, name)


# optimizer classes (torch, DeepSpeed) and the planned optimizer each one is: their state is what the plan counts
_OPTIMIZER_CLASSES = {"AdamW": "adamw", "DeepSpeedCPUAdam": "adamw", "FusedAdam": "adamw", "SGD": "sgd"}


def _max_length(args: Any) -> int | str | None:
    """The sequence length arguments that truncate to one hold (TRL's ``max_length``); None when the class has none."""
    if not hasattr(args, SEQ_FIELD):
        return None
    value = getattr(args, SEQ_FIELD)
    return "None (no truncation)" if value is None else value


def planned_wrap_classes(model: Any, plan: Any = None) -> list[str] | None:
    """The wrap classes ``plan`` recorded (``auto_args``' choice, a user's ``wrap_classes=`` included), else the ones
    hf_dist would pick for ``model`` (None without either)."""
    if getattr(plan, "wrap_classes", None) is not None:
        return sorted(plan.wrap_classes)
    if model is None:
        return None
    # a model FSDP2 already wrapped: fully_shard swaps each unit's class for ``FSDP<Name>`` (torch _fully_shard.py)
    from torch.distributed.fsdp import FSDPModule

    wrapped = any(isinstance(m, FSDPModule) for m in model.modules())
    return sorted(n.removeprefix("FSDP") if wrapped else n for n in fsdp_wrap_classes(model))


# what the plan calls each checked value, and how to get the planned one
_FIXES = {
    "strategy": "pass the TrainingArguments auto_args returned (fsdp / deepspeed), launch without an accelerate "
    "config that sets another engine, and on CPU ranks (tests only) call auto_args(model, ..., engine_on_cpu=True)",
    "world size": "launch as many ranks as planned, or plan for this launch (auto_args(model, gpus=..., nodes=...))",
    "mixed precision": "pass auto_args' bf16 / fp16 values (a TrainingArguments subclass may default to others)",
    "activation checkpointing": "pass auto_args' checkpointing flags unchanged, or plan with "
    "activation_checkpointing=True/False",
    "micro-batch": "pass auto_args' per_device_train_batch_size, or plan with micro_batch_size=",
    "gradient accumulation": "pass auto_args' gradient_accumulation_steps, or plan with global_batch_size=",
    "tp / cp / sp": "pass auto_args' parallelism_config / deepspeed unchanged, or plan with tp_size= / cp_size= / sp_size=",
    "FSDP wrap classes": "pass auto_args' fsdp_config, or wrap_classes= to auto_args",
    "optimizer": "pass auto_args' optim (the planned optimizer) and no optimizers= to the Trainer, or plan with "
    "optimizer='adamw' / 'adamw_8bit' / 'sgd'",
    "sequence length": "pass config_class=<the arguments class, e.g. trl.SFTConfig> to auto_args (it sets max_length "
    "to the plan's seq_len), or plan with seq_len= the max_length you train with",
}


def plan_mismatches(plan: Any, live: dict[str, Any], planned_wrap: list[str] | None = None) -> list[str]:
    """Human-readable differences between ``plan`` and ``live`` (:func:`live_setup`); a value ``live`` lacks or holds
    as None is not checked. Pure."""
    from hf_dist.configs.training_args import trainer_mixed_precision

    planned_sizes = (plan.tp_size, plan.cp_size, plan.sp_size)
    pairs = [
        ("strategy", plan.strategy, live.get("strategy")),
        ("world size", plan.world_size, live.get("world_size")),
        ("mixed precision", trainer_mixed_precision(plan), live.get("mixed_precision")),  # pure bf16 FSDP2: "no"
        ("activation checkpointing", bool(plan.activation_checkpointing), live.get("activation_checkpointing")),
        ("micro-batch", plan.micro_batch_size, live.get("micro_batch_size")),
        ("gradient accumulation", plan.gradient_accumulation_steps, live.get("gradient_accumulation_steps")),
        ("tp / cp / sp", planned_sizes, _sizes(live)),
        ("optimizer", plan.optimizer, live.get("optimizer")),
        ("sequence length", plan.seq_len, live.get("max_length")),
    ]
    if planned_wrap is not None and live.get("wrap_classes") is not None:
        pairs.append(("FSDP wrap classes", planned_wrap, live["wrap_classes"]))
    return [f"{name}: planned {want}, running {got}" for name, want, got in pairs if got is not None and got != want]


def _sizes(live: dict[str, Any]) -> tuple[int, int, int] | None:
    if "tp_size" not in live:
        return None
    return (live["tp_size"], live.get("cp_size", 1), live.get("sp_size", 1))


def mismatch_error(mismatches: list[str]) -> PlanMismatchError:
    lines = [f"  {m}\n    fix: {_FIXES[m.split(':')[0]]}" for m in mismatches]
    return PlanMismatchError(
        "hf_dist: the run the Trainer built is not the one planned; refusing to train:\n"
        + "\n".join(lines)
        + "\n(PlanCallback(plan, strict=False) only warns.)"
    )


class PlanCallback(TrainerCallback):
    """Logs ``plan.explain()`` at train start (rank 0) and refuses to train when the live run differs from the plan
    (:class:`PlanMismatchError` on every rank, naming both values and the fix); ``strict=False`` warns instead.

    The differences are also kept in ``self.mismatches`` (on every rank) so scripts can act on them.
    """

    def __init__(self, plan: Any, *, strict: bool = True) -> None:
        if plan is None or not hasattr(plan, "explain"):
            raise ValueError(f"PlanCallback needs an hf_dist.Plan (from hf_dist.plan(...)), got {plan!r}")
        self.plan = plan
        self.strict = strict
        self.mismatches: list[str] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.strict:
            check_launch(args)
        live = live_setup(args, model, optimizer)
        planned_wrap = planned_wrap_classes(model, self.plan) if live["wrap_classes"] is not None else None
        self.mismatches = plan_mismatches(self.plan, live, planned_wrap)
        if self.mismatches and self.strict:
            raise mismatch_error(self.mismatches)
        if not state.is_world_process_zero:
            return
        text = f"hf_dist plan:\n{self.plan.explain()}"
        # The plan is the first thing to read in a job log, whatever the logging level.
        if logger.isEnabledFor(logging.INFO):
            logger.info(text)
        else:
            print(text, flush=True)
        for item in self.mismatches:
            logger.warning("hf_dist: the live setup differs from the plan: %s", item)
        running = REGISTRY.get(live["strategy"])
        if any(m.startswith("strategy") for m in self.mismatches) and running is not None and running.is_ddp:
            logger.warning(
                "hf_dist: running plain DDP; note that accelerate silently drops FSDP on CPU "
                "(tests and CPU development: auto_args(model, ..., engine_on_cpu=True); else a GPU machine)"
            )
