"""``auto_args()``: a plan turned into ``transformers.TrainingArguments`` kwargs.

    from transformers import TrainingArguments
    import hf_dist

    args = TrainingArguments(output_dir="out", **hf_dist.auto_args(model, global_batch_size=64, learning_rate=2e-5))

The strategy, offload, activation checkpointing and batch split come from :func:`hf_dist.plan`;
the result holds ``fsdp``/``fsdp_config`` or ``deepspeed``, ``bf16``/``fp16`` by hardware,
``per_device_train_batch_size``, ``gradient_accumulation_steps``, activation checkpointing in the
form the strategy needs, and a generous ``ddp_timeout``. Every other keyword is passed to
``TrainingArguments`` as given; user values win, and values that contradict each other raise a
``ValueError`` showing the arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from hf_dist.configs import DEEPSPEED_STRATEGIES, FSDP_STRATEGIES, check_choice
from hf_dist.configs.overrides import apply_strategy_overrides

__all__ = ["auto_args", "PLAN_KEYS", "CONFIG_KEYS", "DEFAULT_DDP_TIMEOUT_S", "scaled_learning_rate"]

# Keywords that go to hf_dist.plan() rather than TrainingArguments.
PLAN_KEYS = (
    "gpus",
    "gpu_memory_gib",
    "nodes",
    "method",
    "seq_len",
    "global_batch_size",
    "micro_batch_size",
    "optimizer",
    "lora_rank",
    "strategy",
    "offload",
    "activation_checkpointing",
    "use_liger_kernel",
    "safety_margin",
    "hardware",
    "pure_bf16",
)
# Keywords auto_args itself consumes.
CONFIG_KEYS = ("plan", "wrap_classes", "lr_scaling", "reference_batch_size", "cpu_adam", "trust_remote_code")

# 3 hours: the first collective waits for the slowest rank, which may be loading, converting or
# `zero.Init`-partitioning a large checkpoint from network storage. torch's default (30 min) kills
# such jobs with a NCCL watchdog timeout although nothing is wrong.
DEFAULT_DDP_TIMEOUT_S = 3 * 60 * 60
DEFAULT_WARMUP_RATIO = 0.03
LR_SCALINGS = ("linear", "sqrt")


def auto_args(model: Any, **overrides: Any) -> dict[str, Any]:
    """Return kwargs for ``TrainingArguments(**kwargs)`` on the installed transformers version.

    ``model``: anything :func:`hf_dist.plan` accepts (name, folder, config, module, PEFT model, count).
    Plan keywords (``gpus, gpu_memory_gib, nodes, method, seq_len, global_batch_size,
    micro_batch_size, optimizer, lora_rank, strategy, offload, activation_checkpointing,
    use_liger_kernel, safety_margin, hardware, pure_bf16``) go to the planner (``use_liger_kernel``
    pins the TrainingArguments flag of the same name; by default the planner turns it on where it
    helps); ``plan=`` passes a ready :class:`~hf_dist.planner.Plan`
    instead. ``wrap_classes`` overrides FSDP wrap-class detection, ``cpu_adam=False`` keeps a torch
    optimizer with DeepSpeed offload. ``lr_scaling="linear"|"sqrt"`` with ``reference_batch_size``
    and ``learning_rate`` (the LR tuned at the reference batch) scales the LR to the global batch and
    adds a 3% warmup unless one is given. Everything else is a ``TrainingArguments`` keyword.

    Precision: bf16/fp16 mixed precision keeps fp32 master weights and fp32 Adam state under every
    strategy. A ``model`` module loaded in bf16/fp16 and trained with DDP / one process has its
    trainable parameters upcast to fp32 in place (one warning says so); FSDP2 and DeepSpeed keep fp32
    masters themselves. ``pure_bf16=True`` keeps bf16 weights and bf16 Adam state instead (no fp32 master
    copy, Adam state at half its size; less accurate updates). See :mod:`hf_dist.precision`.
    """
    plan_kwargs, own, user = _split(overrides)
    if "per_device_train_batch_size" in user:
        mbs = user["per_device_train_batch_size"]
        if plan_kwargs.get("micro_batch_size", mbs) != mbs:
            raise ValueError(
                f"micro_batch_size ({plan_kwargs['micro_batch_size']}) != per_device_train_batch_size ({mbs}); "
                "they are the same thing, pass one."
            )
        plan_kwargs["micro_batch_size"] = mbs
    plan = own.get("plan")
    if plan is None:
        from hf_dist.planner import plan as make_plan

        plan = make_plan(model, **plan_kwargs)
    elif plan_kwargs:
        raise ValueError(f"pass either plan= or planner keywords, not both (got plan= and {sorted(plan_kwargs)}).")

    kwargs = _batch_args(plan, user, gbs_given="global_batch_size" in plan_kwargs)
    kwargs.update(_precision_args(plan))
    if getattr(plan, "use_liger_kernel", False):
        kwargs["use_liger_kernel"] = True  # the planner chose it: fused kernels, less memory, faster
    kwargs.update(_strategy_args(plan, model, own))
    kwargs["ddp_timeout"] = DEFAULT_DDP_TIMEOUT_S
    kwargs.update(
        _lr_args(own, user, kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"], plan)
    )

    apply_strategy_overrides(plan, kwargs, user)  # fsdp / fsdp_config / deepspeed: merged key by key, or refused
    _check_user_overrides(plan, kwargs, user)
    ours_ds = kwargs.get("deepspeed")
    kwargs.update(user)
    if ours_ds is not None and kwargs.get("deepspeed") is ours_ds:
        _sync_deepspeed_precision(kwargs, pure_bf16=bool(getattr(plan, "pure_bf16", False)))
    _check_final(kwargs)
    from hf_dist.precision import check_final_flags, prepare_model

    check_final_flags(plan, kwargs)
    prepare_model(model, plan, "bf16" if kwargs.get("bf16") else "fp16" if kwargs.get("fp16") else "no")
    return kwargs


# ---------------------------------------------------------------- pieces


def _split(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    plan_kwargs = {k: v for k, v in overrides.items() if k in PLAN_KEYS and v is not None}
    own = {k: v for k, v in overrides.items() if k in CONFIG_KEYS}
    user = {k: v for k, v in overrides.items() if k not in PLAN_KEYS and k not in CONFIG_KEYS}
    valid = _training_args_fields()
    unknown = sorted(k for k in user if k not in valid)
    if unknown:
        raise ValueError(
            f"auto_args got unknown keyword(s) {unknown}: not TrainingArguments fields of the installed transformers, "
            f"nor planner keywords {list(PLAN_KEYS)}, nor auto_args keywords {list(CONFIG_KEYS)}."
        )
    return plan_kwargs, own, user


def _training_args_fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments) if f.init}


def _ac_names() -> tuple[str, str]:
    """(flag, kwargs) names for activation checkpointing: transformers 5.23 renamed gradient_checkpointing(_kwargs)."""
    if "activation_checkpointing" in _training_args_fields():
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def _batch_args(plan: Any, user: dict[str, Any], *, gbs_given: bool) -> dict[str, Any]:
    mbs = int(plan.micro_batch_size)
    gas = int(plan.gradient_accumulation_steps)
    world = int(plan.world_size)
    if "gradient_accumulation_steps" in user:
        user_gas = user["gradient_accumulation_steps"]
        if gbs_given and mbs * user_gas * world != plan.global_batch_size:
            raise ValueError(
                f"per_device_train_batch_size({mbs}) * gradient_accumulation_steps({user_gas}) * world_size({world}) "
                f"= {mbs * user_gas * world} != global_batch_size({plan.global_batch_size}); "
                "drop one of them or make the product match."
            )
        gas = user_gas
    return {"per_device_train_batch_size": mbs, "gradient_accumulation_steps": gas}


def _precision_args(plan: Any) -> dict[str, Any]:
    from hf_dist.precision import trainer_mixed_precision

    mixed_precision = trainer_mixed_precision(plan)  # pure bf16 FSDP2: "no" (accelerate would upcast to fp32)
    if mixed_precision != plan.mixed_precision:
        return {"bf16": False}
    if mixed_precision == "bf16":
        return {"bf16": True}
    if mixed_precision == "fp16":
        return {"fp16": True}
    return {}


def _strategy_args(plan: Any, model: Any, own: dict[str, Any]) -> dict[str, Any]:
    strategy = plan.strategy
    ac_flag, ac_kwargs = _ac_names()
    # DDP/DeepSpeed: the model's own checkpointing, non-reentrant (works with frozen inputs under LoRA
    # and with find_unused_parameters=False).
    checkpointing = {ac_flag: True, ac_kwargs: {"use_reentrant": False}} if plan.activation_checkpointing else {}
    if strategy in FSDP_STRATEGIES:
        from hf_dist.configs.fsdp import fsdp_config

        # FSDP checkpoints inside each wrapped block (fsdp_config), not via the model: the
        # Trainer argument would add a redundant all-gather in backward.
        return fsdp_config(
            strategy,
            wrap_classes=_wrap_classes(plan, model, own),
            activation_checkpointing=bool(plan.activation_checkpointing),
            offload=plan.offload,
            mixed_precision=plan.mixed_precision,
            nodes=int(plan.nodes),
            gpus_per_node=int(plan.world_size) // max(int(plan.nodes), 1),
        )
    if strategy in DEEPSPEED_STRATEGIES:
        from hf_dist.configs.deepspeed import deepspeed_config
        from hf_dist.precision import deepspeed_pure_bf16_check

        pure_bf16 = bool(getattr(plan, "pure_bf16", False))
        deepspeed_pure_bf16_check(plan, own.get("cpu_adam", True))
        ds = deepspeed_config(
            strategy,
            offload=plan.offload,
            mixed_precision=plan.mixed_precision,
            cpu_adam=own.get("cpu_adam", True),
            pure_bf16=pure_bf16,
        )
        return {"deepspeed": ds, **checkpointing}
    check_choice("strategy", strategy, ("ddp",))
    # Every parameter gets a gradient in a causal LM (LoRA: every adapter), so DDP need not search
    # the graph for unused ones each step.
    return {"ddp_find_unused_parameters": False, **checkpointing}


def _wrap_classes(plan: Any, model: Any, own: dict[str, Any]) -> list[str] | None:
    from hf_dist.wrap import fsdp_wrap_classes

    requested = own.get("wrap_classes")
    source = model if not isinstance(model, (int, float)) else getattr(plan.model, "config", None)
    if source is None:  # a bare parameter count: accelerate falls back to the model's _no_split_modules
        if requested:
            return list(requested)
        return None
    if not hasattr(source, "modules") and getattr(plan.model, "config", None) is not None:
        source = plan.model.config  # a name/folder was already resolved by the planner
    return fsdp_wrap_classes(source, requested, trust_remote_code=own.get("trust_remote_code", False))


def scaled_learning_rate(base_lr: float, global_batch_size: int, reference_batch_size: int, rule: str) -> float:
    """LR for ``global_batch_size`` given ``base_lr`` tuned at ``reference_batch_size``.

    linear: Goyal et al. 2017 ("Accurate, Large Minibatch SGD"); sqrt: Krizhevsky 2014 /
    Malladi et al. 2022 (square-root rule for Adam).
    """
    check_choice("lr_scaling", rule, LR_SCALINGS)
    if reference_batch_size <= 0 or global_batch_size <= 0:
        raise ValueError(
            f"batch sizes must be positive: global_batch_size={global_batch_size}, "
            f"reference_batch_size={reference_batch_size}."
        )
    ratio = global_batch_size / reference_batch_size
    return base_lr * (ratio if rule == "linear" else math.sqrt(ratio))


def _lr_args(own: dict[str, Any], user: dict[str, Any], mbs: int, gas: int, plan: Any) -> dict[str, Any]:
    rule = own.get("lr_scaling")
    if rule is None:
        if "reference_batch_size" in own:
            raise ValueError(
                "reference_batch_size is only used with lr_scaling='linear' or 'sqrt'; pass lr_scaling too."
            )
        return {}
    check_choice("lr_scaling", rule, LR_SCALINGS)
    ref = own.get("reference_batch_size")
    if ref is None or "learning_rate" not in user:
        raise ValueError(
            f"lr_scaling={rule!r} needs reference_batch_size (the batch the LR was tuned at) and learning_rate "
            f"(that LR); got reference_batch_size={ref!r}, learning_rate={user.get('learning_rate')!r}."
        )
    global_batch = mbs * gas * int(plan.world_size)
    out: dict[str, Any] = {"learning_rate": scaled_learning_rate(user.pop("learning_rate"), global_batch, ref, rule)}
    if not any(k in user for k in ("warmup_ratio", "warmup_steps")):
        # transformers 5.x dropped warmup_ratio; a float warmup_steps in [0, 1) is a ratio there.
        key = "warmup_ratio" if "warmup_ratio" in _training_args_fields() else "warmup_steps"
        out[key] = DEFAULT_WARMUP_RATIO
    return out


def _check_user_overrides(plan: Any, ours: dict[str, Any], user: dict[str, Any]) -> None:
    if user.get("bf16") and plan.mixed_precision == "fp16":
        raise ValueError(
            f"bf16=True but the hardware ({plan.hardware.gpu_name or plan.hardware.device}) has no bf16 support; "
            "use fp16=True (the plan's choice) or drop bf16."
        )
    if ("fsdp" in ours and user.get("deepspeed")) or ("deepspeed" in ours and user.get("fsdp")):
        chosen = plan.strategy
        raise ValueError(
            f"the plan chose {chosen} but you passed {'deepspeed' if user.get('deepspeed') else 'fsdp'}=...; "
            "FSDP and DeepSpeed cannot both be on. Force the strategy with strategy='zero3' (or 'fsdp_full_shard') "
            "instead of passing the config."
        )
    ac_flag, _ = _ac_names()
    user_ac = user.get(ac_flag) or user.get("gradient_checkpointing")
    if "fsdp" in ours and user_ac:
        raise ValueError(
            f"{ac_flag}=True with FSDP ({plan.strategy}) checkpoints through the model and adds a redundant "
            "all-gather; pass activation_checkpointing=True to auto_args (planner keyword) so it goes to fsdp_config."
        )


def _sync_deepspeed_precision(kwargs: dict[str, Any], *, pure_bf16: bool = False) -> None:
    """Keep our DeepSpeed JSON's precision equal to the final bf16/fp16 flags (the Trainer checks they match)."""
    from hf_dist.configs.deepspeed import _precision_section

    mp = "bf16" if kwargs.get("bf16") else "fp16" if kwargs.get("fp16") else "no"
    kwargs["deepspeed"] = {**kwargs["deepspeed"], **_precision_section(mp, pure_bf16=pure_bf16 and mp == "bf16")}


def _check_final(kwargs: dict[str, Any]) -> None:
    if kwargs.get("fsdp") and kwargs.get("deepspeed"):
        raise ValueError(
            "fsdp and deepspeed are both set; choose one strategy (strategy='zero3' or 'fsdp_full_shard')."
        )
    if kwargs.get("bf16") and kwargs.get("fp16"):
        raise ValueError("bf16=True and fp16=True are both set; pass only one.")
    launcher_ds_fields = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "")
    clashing = {"zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps"}
    if kwargs.get("deepspeed") and clashing & set(launcher_ds_fields.split(",")):
        raise ValueError(
            "auto_args chose DeepSpeed, but this process was launched with an accelerate DeepSpeed config that sets "
            f"{sorted(clashing & set(launcher_ds_fields.split(',')))}; accelerate refuses both. Launch with "
            "accelerate_configs/ddp.yaml or torchrun (auto_args supplies the DeepSpeed JSON)."
        )
