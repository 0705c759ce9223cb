"""``auto_args()``: a plan turned into ``transformers.TrainingArguments`` kwargs for this machine.

    from transformers import TrainingArguments
    import hf_dist

    args = TrainingArguments(output_dir="out", **hf_dist.auto_args(model, global_batch_size=64, learning_rate=2e-5))

The thin layer above :mod:`hf_dist.planning.planner` and the pure factories of :mod:`hf_dist.configs`, and the
one place that looks at the installed library versions (``installed_features``), the environment (an
accelerate launcher's DeepSpeed fields) and the model (FSDP wrap classes, precision). The strategy, offload,
activation checkpointing and batch split come from :func:`hf_dist.plan`; the result holds ``fsdp``/``fsdp_config``
or ``deepspeed``, ``bf16``/``fp16`` by hardware, the planned optimizer as ``optim``, ``per_device_train_batch_size``,
``gradient_accumulation_steps``, activation checkpointing in the form the strategy needs, and a generous
``ddp_timeout``. Every other keyword is passed to ``TrainingArguments`` as given; user values win where they do not
contradict the plan. The plan itself rides in the kwargs (``fsdp_config["hf_dist_plan"]``, in every layout:
:mod:`hf_dist.runtime.planned`), where ``hf_dist.callbacks.attach(trainer)`` finds it in ``trainer.args`` and checks
the live run against it.

One way, one check: the keywords are sorted (:mod:`~hf_dist.configs.request`), planned, rendered
(:mod:`~hf_dist.configs.training_args`), merged with the user's fields (:mod:`~hf_dist.configs.overrides`), and
validated once (:mod:`~hf_dist.configs.validate`): every value that contradicts the plan or another value is
reported in one ``ValueError`` (:func:`hf_dist.validation.raise_contradictions`, the arithmetic shown) before the
model is touched (:mod:`hf_dist.runtime.precision`).
"""

from __future__ import annotations

import os
from typing import Any

from hf_dist.configs.overrides import apply_strategy_overrides
from hf_dist.configs.request import Request, read_request
from hf_dist.configs.training_args import training_kwargs
from hf_dist.configs.validate import validate
from hf_dist.planning.request import PlanRequest

__all__ = ["auto_args"]


def auto_args(model: Any, request: PlanRequest | None = None, **overrides: Any) -> dict[str, Any]:
    """Return kwargs for ``TrainingArguments(**kwargs)`` on the installed transformers version.

    ``model``: anything :func:`hf_dist.plan` accepts (name, folder, config, module, PEFT model, count); a
    ``PeftModel``'s own LoRA is planned, and ``peft_config=`` (a PEFT ``LoraConfig``) plans one before the model exists.
    Plan keywords (the fields of :class:`~hf_dist.planning.request.PlanRequest` but ``features``, each with its help
    text there; or ``request``, a ``PlanRequest``, whose fields set to other than their defaults count as keywords of
    the same names, a field given both ways with different values refused) go to the planner (``verify=True`` traces
    the chosen layout on the real model with fake tensors and takes the next one if the trace does not fit) (``use_liger_kernel``
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
    ``trust_remote_code=True`` lets a model folder's ``auto_map`` classes be imported (planning, tracing, FSDP wrap
    classes); without it they never are (:mod:`hf_dist.planning.remote_code`). ``engine_on_cpu=True`` (tests and CPU
    development): an FSDP2 or ZeRO plan launched on CPU ranks runs there
    (:func:`hf_dist.runtime.cpu_fsdp.engine_on_cpu_ranks`); without it such a plan is refused, since accelerate would
    train plain DDP instead of FSDP and set DeepSpeed up for one rank.

    Precision: bf16/fp16 mixed precision keeps fp32 master weights and fp32 Adam state under every
    strategy. A ``model`` module loaded in bf16/fp16 and trained with DDP / one process has its
    trainable parameters upcast to fp32 in place (one warning says so); FSDP2 and DeepSpeed keep fp32
    masters themselves. ``pure_bf16=True`` keeps bf16 weights and bf16 Adam state instead (no fp32 master
    copy, Adam state at half its size; less accurate updates). See :mod:`hf_dist.runtime.precision`.
    """
    from hf_dist.planning.features import installed_features
    from hf_dist.runtime import planned
    from hf_dist.runtime.cpu_fsdp import cpu_ranks
    from hf_dist.runtime.launch import check_one_process_launch

    check_one_process_launch()  # `accelerate launch --num_processes 2` that started one process
    features = installed_features()
    asked = read_request(overrides, request)  # 1. the keywords sorted: planner, auto_args', TrainingArguments'
    plan = _plan(model, asked)  # 2. the plan
    plan = _with_wrap_classes(plan, model, asked.own)  # 3. the FSDP wrap classes, recorded in the plan
    ours = _generate(plan, asked, features)  # 4. the plan as TrainingArguments kwargs
    final, merge_conflicts = _merge(plan, ours, asked)  # 5. the user's fields merged in
    validate(  # 6. every contradiction at once, before anything touches the model
        plan,
        asked,
        final,
        merge_conflicts=merge_conflicts,
        features=features,
        launcher_ds_fields=os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", ""),
        cpu_ranks=cpu_ranks(),
        engine_on_cpu=_engine_on_cpu(plan, asked),
    )
    _prepare(model, plan, final, asked)  # 7. the model and the live objects
    return planned.carry(final, plan)  # 8. the plan inside the kwargs: where attach(trainer) finds it


def _plan(model: Any, request: Request) -> Any:
    """The plan of ``request`` (or the one it passes). A user ``gradient_accumulation_steps`` without a global batch
    is planned too: gradients that persist across micro-batches cost memory (FSDP2, ZeRO-1), and the live run is
    checked against the plan's accumulation."""
    if request.given_plan is not None:
        return request.given_plan
    plan = _make_plan(model, request, request.plan_kwargs)
    gas = request.user.get("gradient_accumulation_steps")
    if gas is None or "global_batch_size" in request.plan_kwargs or gas == plan.gradient_accumulation_steps:
        return plan
    return _make_plan(model, request, _with_accumulation(plan, request.plan_kwargs, gas))


def _make_plan(model: Any, request: Request, plan_kwargs: dict[str, Any]) -> Any:
    from hf_dist.tracing.checked_plan import plan as make_plan

    return make_plan(model, trust_remote_code=request.own.get("trust_remote_code", False), **plan_kwargs)


def _with_accumulation(plan: Any, plan_kwargs: dict[str, Any], gas: int) -> dict[str, Any]:
    """``plan``'s layout and micro-batch pinned, its global batch made of ``gas`` accumulation steps."""
    pinned = {
        "strategy": plan.strategy,
        "offload": plan.offload,
        "activation_checkpointing": plan.activation_checkpointing,
        "use_liger_kernel": plan.use_liger_kernel,
        "tp_size": plan.tp_size,
        "cp_size": plan.cp_size,
        "sp_size": plan.sp_size,
        "micro_batch_size": plan.micro_batch_size,
        "global_batch_size": plan.micro_batch_size * gas * plan.layout.dp_size,
    }
    if plan.offload != "none":
        pinned["offload_device"] = plan.offload_device
    return {**plan_kwargs, **pinned}


def _engine_on_cpu(plan: Any, request: Request) -> bool:
    """Whether the planned engine was opted in for CPU ranks: ``engine_on_cpu=True``, or FSDP on CPU already turned on
    in this process (:func:`hf_dist.runtime.cpu_fsdp.enable_fsdp_on_cpu`: the recipes' ``--fsdp_on_cpu``)."""
    if request.own.get("engine_on_cpu"):
        return True
    if not plan.layout.strategy.is_fsdp:
        return False
    from hf_dist.runtime.cpu_fsdp import fsdp_on_cpu_enabled

    return fsdp_on_cpu_enabled()


def _generate(plan: Any, request: Request, features: Any) -> dict[str, Any]:
    """What hf_dist sets from the plan: :func:`~hf_dist.configs.training_args.training_kwargs`, with the plan's FSDP
    wrap classes, ZeRO-Infinity's checked swap folder, and what CPU ranks need."""
    from hf_dist.runtime.cpu_fsdp import cpu_launch_kwargs

    layout = plan.layout
    out = training_kwargs(plan, request, features, wrap_classes=plan.wrap_classes, nvme=_nvme(plan, request))
    out.update(cpu_launch_kwargs(layout.strategy.is_deepspeed))  # CPU ranks that train as one job
    out["dataloader_pin_memory"] = plan.hardware.device == "cuda"  # pinning needs CUDA (warns on CPU)
    return out


def _nvme(plan: Any, request: Request) -> dict[str, Any]:
    """ZeRO-Infinity's swap folder (checked writable, with room for the swap files) and parameter buffer size."""
    layout = plan.layout
    if layout.offload_device != "nvme":
        return {}
    from hf_dist.planning.model_states import nvme_param_buffer
    from hf_dist.runtime.support import check_nvme_offload

    check_nvme_offload(request.own.get("nvme_path"), plan.swap_bytes)
    return {
        "nvme_path": request.own.get("nvme_path"),
        "nvme_param_buffer": nvme_param_buffer(plan.model, layout.state_shard_size),
    }


def _merge(plan: Any, ours: dict[str, Any], request: Request) -> tuple[dict[str, Any], list[str]]:
    """The user's fields over ours: engine configs merged key by key (contradicting keys kept as the plan's and
    returned as conflicts), every other field as given (a precision flag or ``optim`` that contradicts the plan is
    then refused by the validation step, so our DeepSpeed JSON's precision stays the final flags')."""
    user = dict(request.user)
    conflicts = apply_strategy_overrides(plan, ours, user)  # fsdp / fsdp_config / deepspeed / parallelism_config
    return {**ours, **user}, conflicts


def _prepare(model: Any, plan: Any, final: dict[str, Any], request: Request) -> None:
    """What a validated request changes outside the kwargs: the model's precision and KV cache, DeepSpeed's
    warnings, accelerate's ``ParallelismConfig`` object, and the planned engine on CPU ranks (``engine_on_cpu``)."""
    from hf_dist.runtime.precision import prepare_model

    strategy = plan.layout.strategy
    if strategy.is_deepspeed:
        _quiet_deepspeed_collectives()
    prepare_model(model, plan, "bf16" if final.get("bf16") else "fp16" if final.get("fp16") else "no")
    disable_kv_cache_under_checkpointing(model, plan)
    if isinstance(final.get("parallelism_config"), dict):
        final["parallelism_config"] = build_parallelism_config(final["parallelism_config"])
    if request.own.get("engine_on_cpu"):
        from hf_dist.runtime.cpu_fsdp import engine_on_cpu_ranks

        _merge_accelerator_config(final, engine_on_cpu_ranks(fsdp=strategy.is_fsdp, deepspeed=strategy.is_deepspeed))


def _merge_accelerator_config(final: dict[str, Any], extra: dict[str, Any]) -> None:
    """``extra``'s kwargs into ``final``; an ``accelerator_config`` dict of the user's keeps its other keys."""
    given = final.get("accelerator_config")
    if isinstance(given, dict) and isinstance(extra.get("accelerator_config"), dict):
        extra = {**extra, "accelerator_config": {**given, **extra["accelerator_config"]}}
    final.update(extra)


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


def _with_wrap_classes(plan: Any, model: Any, own: dict[str, Any]) -> Any:
    """``plan`` with the FSDP wrap classes its run uses (the user's ``wrap_classes=``, checked against the model, or
    the ones found in it), so that ``attach`` checks the live run against what was emitted, not a fresh guess."""
    import dataclasses

    if not plan.layout.strategy.is_fsdp:
        return plan
    wrap = _wrap_classes(plan, model, own)
    return dataclasses.replace(plan, wrap_classes=None if wrap is None else list(wrap))


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


def from_pretrained_kwargs(layout: Any) -> dict[str, Any]:
    """What ``AutoModelForCausalLM.from_pretrained`` needs for ``layout`` (``plan.layout``) with the installed
    transformers: :func:`hf_dist.configs.training_args.from_pretrained_kwargs` for the probed features."""
    from hf_dist.configs.training_args import from_pretrained_kwargs as for_features
    from hf_dist.planning.features import installed_features

    return for_features(layout, installed_features())
