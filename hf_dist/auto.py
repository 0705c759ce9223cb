"""``auto_args()``: a plan turned into ``transformers.TrainingArguments`` kwargs for this machine.

    from transformers import TrainingArguments
    import hf_dist

    args = TrainingArguments(output_dir="out", **hf_dist.auto_args(model, global_batch_size=64, learning_rate=2e-5))

The thin layer above :mod:`hf_dist.planning.planner` and the pure factories of :mod:`hf_dist.configs`, and the
one place that looks at the installed library versions (``installed_features``), the environment (an
accelerate launcher's DeepSpeed fields) and the model (FSDP wrap classes, precision). The strategy, offload,
activation checkpointing and batch split come from :func:`hf_dist.plan`; the result holds ``fsdp``/``fsdp_config``
or ``deepspeed``, ``bf16``/``fp16`` by hardware, ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
activation checkpointing in the form the strategy needs, and a generous ``ddp_timeout``. Every other keyword is
passed to ``TrainingArguments`` as given; user values win, and values that contradict each other raise a
``ValueError`` showing the arithmetic.
"""

from __future__ import annotations

import os
from typing import Any

from hf_dist.configs.config_class import class_fields, plan_from_class
from hf_dist.configs.overrides import apply_strategy_overrides
from hf_dist.configs.training_args import (
    CONFIG_KEYS,
    DEFAULT_DDP_TIMEOUT_S,
    PLAN_KEYS,
    batch_args,
    check_final,
    check_user_overrides,
    lr_args,
    precision_args,
    strategy_args,
    sync_deepspeed_precision,
)

__all__ = ["auto_args"]


def auto_args(model: Any, **overrides: Any) -> dict[str, Any]:
    """Return kwargs for ``TrainingArguments(**kwargs)`` on the installed transformers version.

    ``model``: anything :func:`hf_dist.plan` accepts (name, folder, config, module, PEFT model, count).
    Plan keywords (``gpus, gpu_memory_gib, nodes, method, seq_len, global_batch_size,
    micro_batch_size, optimizer, lora_rank, strategy, offload, activation_checkpointing,
    use_liger_kernel, safety_margin, hardware, pure_bf16, tp_size, cp_size, sp_size, host_memory_gib,
    nvme_gbps, fused_lm_head, async_save, train_tokens, verify, verify_time_limit_s``) go to the planner (``verify=True`` traces the chosen layout on the real
    model with fake tensors and takes the next one if the trace does not fit) (``use_liger_kernel``
    pins the TrainingArguments flag of the same name; by default the planner turns it on where it
    helps); ``plan=`` passes a ready :class:`~hf_dist.planning.planner.Plan`
    instead. ``wrap_classes`` overrides FSDP wrap-class detection, ``cpu_adam=False`` keeps a torch
    optimizer with DeepSpeed offload. ``nvme_path``: the folder ZeRO-Infinity swaps to when the plan offloads to
    NVMe (required then; checked writable, and DeepSpeed's async-I/O op must be buildable: libaio). ``lr_scaling="linear"|"sqrt"`` with ``reference_batch_size``
    and ``learning_rate`` (the LR tuned at the reference batch) scales the LR to the global batch and
    adds a 3% warmup unless one is given. ``config_class``: the ``TrainingArguments`` subclass the kwargs are for
    (TRL's ``SFTConfig``): its fields are accepted, and its ``max_length`` is the plan's sequence length
    (:mod:`hf_dist.configs.config_class`). Everything else is a ``TrainingArguments`` (or ``config_class``) keyword;
    every key the plan depends on is emitted explicitly, so a subclass's own defaults cannot replace it.

    Precision: bf16/fp16 mixed precision keeps fp32 master weights and fp32 Adam state under every
    strategy. A ``model`` module loaded in bf16/fp16 and trained with DDP / one process has its
    trainable parameters upcast to fp32 in place (one warning says so); FSDP2 and DeepSpeed keep fp32
    masters themselves. ``pure_bf16=True`` keeps bf16 weights and bf16 Adam state instead (no fp32 master
    copy, Adam state at half its size; less accurate updates). See :mod:`hf_dist.runtime.precision`.
    """
    from hf_dist.planning.features import installed_features
    from hf_dist.runtime.cpu_fsdp import cpu_launch_kwargs
    from hf_dist.runtime.launch import check_one_process_launch
    from hf_dist.runtime.precision import check_final_flags, deepspeed_pure_bf16_check, prepare_model

    check_one_process_launch()  # `accelerate launch --num_processes 2` that started one process
    features = installed_features()
    plan_kwargs, own, user = _split(overrides)
    from_class = plan_from_class(own.get("config_class"), plan_kwargs, user, own.get("plan"))  # e.g. TRL's max_length
    plan = _plan(model, plan_kwargs, own, user)
    kwargs = batch_args(plan, user, gbs_given="global_batch_size" in plan_kwargs)
    kwargs.update(precision_args(plan))
    if getattr(plan, "use_liger_kernel", False):
        kwargs["use_liger_kernel"] = True  # the planner chose it: fused kernels, less memory, faster
    layout = plan.layout
    if layout.strategy.is_deepspeed:
        deepspeed_pure_bf16_check(plan, own.get("cpu_adam", True))
        _quiet_deepspeed_collectives()
    wrap = _wrap_classes(plan, model, own) if layout.strategy.is_fsdp else None
    nvme = {}
    if layout.offload_device == "nvme":
        from hf_dist.planning.model_states import nvme_param_buffer
        from hf_dist.runtime.support import check_nvme_offload

        check_nvme_offload(own.get("nvme_path"), plan.swap_bytes)
        nvme = {
            "nvme_path": own.get("nvme_path"),
            "nvme_param_buffer": nvme_param_buffer(plan.model, layout.state_shard_size),
        }
    kwargs.update(
        strategy_args(layout, features=features, wrap_classes=wrap, cpu_adam=own.get("cpu_adam", True), **nvme)
    )
    kwargs["ddp_timeout"] = DEFAULT_DDP_TIMEOUT_S
    kwargs.update(from_class)
    mbs, gas = kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"]
    kwargs.update(lr_args(own, user, mbs, gas, plan, features))

    apply_strategy_overrides(plan, kwargs, user)  # fsdp / fsdp_config / deepspeed: merged key by key, or refused
    check_user_overrides(plan, kwargs, user, features)
    kwargs.update(cpu_launch_kwargs(layout.strategy.is_deepspeed))  # CPU ranks that train as one job
    kwargs["dataloader_pin_memory"] = plan.hardware.device == "cuda"  # pinning needs CUDA (warns on CPU)
    ours_ds = kwargs.get("deepspeed")
    kwargs.update(user)
    if ours_ds is not None and kwargs.get("deepspeed") is ours_ds:
        sync_deepspeed_precision(kwargs, pure_bf16=bool(getattr(plan, "pure_bf16", False)))
    check_final(kwargs)
    _check_launcher(kwargs)
    check_final_flags(plan, kwargs)
    prepare_model(model, plan, "bf16" if kwargs.get("bf16") else "fp16" if kwargs.get("fp16") else "no")
    disable_kv_cache_under_checkpointing(model, plan)
    if isinstance(kwargs.get("parallelism_config"), dict):
        kwargs["parallelism_config"] = build_parallelism_config(kwargs["parallelism_config"])
    return kwargs


def disable_kv_cache_under_checkpointing(model: Any, plan: Any) -> None:
    """Turn the KV cache off when the plan checkpoints activations, as transformers does for its own gradient
    checkpointing ("use_cache=True is incompatible with gradient checkpointing").

    Under FSDP2 hf_dist checkpoints through accelerate (``fsdp_config``), which transformers does not see: with the
    config's ``use_cache=True`` every checkpointed layer is handed the ``DynamicCache``, which keeps each layer's
    K/V alive through backward (traced: Mistral 7B at 8k tokens on 64 ranks 15.1 GiB instead of 7.3), and on
    transformers 5.0 the recompute appends to it again and torch's checkpoint refuses the longer K/V. A no-op for
    names, configs and counts (the recipes pass the model)."""
    config = getattr(model, "config", None)
    if not plan.activation_checkpointing or not getattr(config, "use_cache", False):
        return
    import logging

    config.use_cache = False
    logging.getLogger("hf_dist").info("activation checkpointing: the model's KV cache is off (config.use_cache=False)")


def build_parallelism_config(data: dict[str, Any]) -> Any:
    """accelerate's ``ParallelismConfig`` from :func:`~hf_dist.configs.training_args.parallelism_kwargs`'s plain data
    (``sp_attn_implementation`` becomes the ``DeepSpeedSequenceParallelConfig`` handler)."""
    from accelerate.parallelism_config import ParallelismConfig

    data = dict(data)
    attn = data.pop("sp_attn_implementation", None)
    if attn is not None:
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        data["sp_handler"] = DeepSpeedSequenceParallelConfig(sp_attn_implementation=attn)
    return ParallelismConfig(**data)


def _plan(model: Any, plan_kwargs: dict[str, Any], own: dict[str, Any], user: dict[str, Any]) -> Any:
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
        from hf_dist.tracing.verify import plan as make_plan

        return make_plan(model, **plan_kwargs)
    if plan_kwargs:
        raise ValueError(f"pass either plan= or planner keywords, not both (got plan= and {sorted(plan_kwargs)}).")
    return plan


def _split(overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    from transformers import TrainingArguments

    plan_kwargs = {k: v for k, v in overrides.items() if k in PLAN_KEYS and v is not None}
    own = {k: v for k, v in overrides.items() if k in CONFIG_KEYS}
    user = {k: v for k, v in overrides.items() if k not in PLAN_KEYS and k not in CONFIG_KEYS}
    config_class = own.get("config_class") or TrainingArguments
    unknown = sorted(k for k in user if k not in class_fields(config_class))
    if unknown:
        raise ValueError(
            f"auto_args got unknown keyword(s) {unknown}: not fields of {config_class.__name__} (config_class=) of the "
            f"installed versions, nor planner keywords {list(PLAN_KEYS)}, nor auto_args keywords {list(CONFIG_KEYS)}."
        )
    return plan_kwargs, own, user


def _wrap_classes(plan: Any, model: Any, own: dict[str, Any]) -> list[str] | None:
    from hf_dist.planning.wrap import fsdp_wrap_classes

    requested = own.get("wrap_classes")
    source = model if not isinstance(model, (int, float)) else getattr(plan.model, "config", None)
    if source is None:  # a bare parameter count: accelerate falls back to the model's _no_split_modules
        if requested:
            return list(requested)
        return None
    if not hasattr(source, "modules") and getattr(plan.model, "config", None) is not None:
        source = plan.model.config  # a name/folder was already resolved by the planner
    return fsdp_wrap_classes(source, requested, trust_remote_code=own.get("trust_remote_code", False))


def _quiet_deepspeed_collectives() -> None:
    """DeepSpeed's ZeRO-3 gathers through ``torch.distributed.all_gather_into_tensor``, which torch 2.13 marks
    deprecated: one FutureWarning per call site and rank, hundreds of lines in a run. Shown once per process."""
    import warnings

    warnings.filterwarnings("once", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated")


def _check_launcher(kwargs: dict[str, Any]) -> None:
    launcher_ds_fields = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "")
    clashing = {"zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps"}
    if kwargs.get("deepspeed") and clashing & set(launcher_ds_fields.split(",")):
        raise ValueError(
            "auto_args chose DeepSpeed, but this process was launched with an accelerate DeepSpeed config that sets "
            f"{sorted(clashing & set(launcher_ds_fields.split(',')))}; accelerate refuses both. Launch with "
            "accelerate_configs/ddp.yaml or torchrun (auto_args supplies the DeepSpeed JSON)."
        )
