"""Pure pieces of ``TrainingArguments`` kwargs for a plan: the strategy emitter, batch split, precision, LR.

:func:`strategy_args` is the one place a layout's strategy becomes ``TrainingArguments`` kwargs; ``hf_dist.auto_args``
(``hf_dist/auto.py``), the accelerate YAML writer and ``hf-dist bench`` all call it. Nothing here reads the
environment or probes the installed libraries: what they accept comes in as ``features``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from hf_dist.configs.deepspeed import deepspeed_config
from hf_dist.configs.fsdp import fsdp_config
from hf_dist.configs.optimizer import trainer_optim
from hf_dist.configs.request import Request
from hf_dist.planning.features import NEWEST_TESTED_FEATURES, LibraryFeatures, check_features
from hf_dist.planning.layout import Layout, strategy
from hf_dist.validation import check_choice

__all__ = [
    "strategy_args",
    "sync_each_batch_config",
    "parallelism_kwargs",
    "from_pretrained_kwargs",
    "training_kwargs",
    "trainer_mixed_precision",
    "DEFAULT_DDP_TIMEOUT_S",
    "scaled_learning_rate",
]

# 3 hours: the first collective waits for the slowest rank, which may be loading, converting or
# `zero.Init`-partitioning a large checkpoint from network storage. torch's default (30 min) kills
# such jobs with a NCCL watchdog timeout although nothing is wrong.
DEFAULT_DDP_TIMEOUT_S = 3 * 60 * 60
DEFAULT_WARMUP_RATIO = 0.03
LR_SCALINGS = ("linear", "sqrt")


# ---------------------------------------------------------------- pieces


def training_kwargs(
    plan: Any,
    request: Request,
    features: LibraryFeatures,
    *,
    wrap_classes: Sequence[str] | None = None,
    nvme: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything ``auto_args`` generates from ``plan`` before the user's fields are merged: the batch split,
    precision, the optimizer, the strategy's engine config, the timeout, ``config_class``'s planned fields and a
    scaled LR."""
    out = batch_args(plan, request.user)
    out.update(precision_args(plan))
    out["optim"] = trainer_optim(plan.optimizer, features)  # the optimizer whose state the plan counts
    if getattr(plan, "use_liger_kernel", False):
        out["use_liger_kernel"] = True  # the planner chose it: fused kernels, less memory, faster
    out.update(
        strategy_args(
            plan.layout, features=features, wrap_classes=wrap_classes, cpu_adam=request.cpu_adam, **(nvme or {})
        )
    )
    out["ddp_timeout"] = DEFAULT_DDP_TIMEOUT_S
    out.update(request.from_class)
    out.update(
        lr_args(request, out["per_device_train_batch_size"], out["gradient_accumulation_steps"], plan, features)
    )
    return out


def batch_args(plan: Any, user: dict[str, Any]) -> dict[str, Any]:
    """The plan's micro-batch and accumulation steps (the user's ``gradient_accumulation_steps`` wins; whether it
    still gives the planned global batch is checked by :func:`hf_dist.configs.validate.contradictions`)."""
    gas = user.get("gradient_accumulation_steps", int(plan.gradient_accumulation_steps))
    return {"per_device_train_batch_size": int(plan.micro_batch_size), "gradient_accumulation_steps": gas}


def precision_args(plan: Any) -> dict[str, Any]:
    mixed_precision = trainer_mixed_precision(plan)  # pure bf16 FSDP2: "no" (accelerate would upcast to fp32)
    # both flags, explicitly: a TrainingArguments subclass may default to bf16=True (TRL's SFTConfig)
    return {"bf16": mixed_precision == "bf16", "fp16": mixed_precision == "fp16"}


def trainer_mixed_precision(plan: Any) -> str:
    """The precision ``TrainingArguments`` get for ``plan``: "no" for pure bf16 under FSDP2, else the plan's.

    accelerate upcasts FSDP2 parameters to fp32 whenever mixed precision is on, so pure bf16 FSDP2 runs
    with ``bf16=False``: the bf16 weights set the compute dtype.
    """
    if getattr(plan, "pure_bf16", False) and strategy(plan.strategy).is_fsdp:
        return "no"
    return plan.mixed_precision


def strategy_args(
    layout: Layout,
    *,
    features: LibraryFeatures = NEWEST_TESTED_FEATURES,
    wrap_classes: Sequence[str] | None = None,
    cpu_adam: bool = True,
    cpu_ram_efficient_loading: bool = True,
    nvme_path: str | None = None,
    nvme_param_buffer: int | None = None,
) -> dict[str, Any]:
    """The one strategy -> ``TrainingArguments`` kwargs emitter (auto_args, the accelerate YAML and bench use it).

    FSDP: ``fsdp``/``fsdp_config`` (checkpointing inside each wrapped block: the Trainer's flag would add a
    redundant all-gather in backward), for HSDP ``parallelism_config`` as ``ParallelismConfig`` kwargs
    (a dict: :func:`hf_dist.auto_args` builds the object), and with ``layout.sync_each_batch`` the
    ``accelerator_config`` that reduce-scatters every micro-batch (:func:`sync_each_batch_config`). DeepSpeed: the JSON as a dict, with the model's own
    non-reentrant checkpointing (works with frozen inputs under LoRA). DDP: no unused-parameter search
    (every parameter of a causal LM gets a gradient; under LoRA every adapter).

    Model parallelism: ``tp_size``/``cp_size`` (FSDP2 or TP alone) and ``sp_size`` (DeepSpeed Ulysses) add
    ``parallelism_config``; DeepSpeed TP is AutoTP inside the JSON. Loading a TP model needs
    :func:`from_pretrained_kwargs`, and the Trainer checkpoints its weights only (``save_only_model=True``:
    transformers cannot checkpoint or resume the optimizer state of a model sharded at load;
    :class:`hf_dist.callbacks.ShardedResumeCallback` adds it).
    ``nvme_path``: where ZeRO-Infinity swaps (required with NVMe offload); ``nvme_param_buffer``: its parameter
    buffers' elements (default: DeepSpeed's 1e8; ``auto_args`` sizes them to the model's largest partition).
    Layouts the ``features`` cannot run are refused with the versions they need.
    """
    check_features(layout, features)
    if layout.strategy.is_fsdp:
        return _fsdp_args(layout, features, wrap_classes, cpu_ram_efficient_loading)
    if layout.strategy.is_deepspeed:
        engine = {"cpu_adam": cpu_adam, "nvme_path": nvme_path}
        if nvme_param_buffer:
            engine["nvme_param_buffer"] = nvme_param_buffer
        return _deepspeed_args(layout, features, engine)
    return _ddp_args(layout, features)


def _checkpointing(layout: Layout, features: LibraryFeatures) -> dict[str, Any]:
    """The Trainer's activation-checkpointing flag, explicit either way: a ``TrainingArguments`` subclass (TRL's
    ``SFTConfig``: ``gradient_checkpointing=True``) has other defaults. Non-reentrant: works with frozen inputs."""
    ac_flag, ac_kwargs = features.activation_checkpointing_field, features.activation_checkpointing_kwargs_field
    if layout.activation_checkpointing:
        return {ac_flag: True, ac_kwargs: {"use_reentrant": False}}
    return {ac_flag: False}


def _fsdp_args(layout: Layout, features: LibraryFeatures, wrap_classes, cpu_ram_efficient_loading) -> dict[str, Any]:
    out = fsdp_config(
        layout, wrap_classes=wrap_classes, cpu_ram_efficient_loading=cpu_ram_efficient_loading, features=features
    )
    if features.fsdp_version == 2 and (layout.dp_replicate_size > 1 or _model_parallel(layout)):
        out["parallelism_config"] = parallelism_kwargs(layout)
    if layout.sync_each_batch:
        out["accelerator_config"] = sync_each_batch_config()
    # FSDP checkpoints inside fsdp_config: the Trainer's flag would add a redundant all-gather in backward
    return {**out, features.activation_checkpointing_field: False, **_sharded_at_load(layout)}


def sync_each_batch_config() -> dict[str, Any]:
    """``TrainingArguments.accelerator_config`` that makes the Trainer reduce-scatter every micro-batch under FSDP2:
    it builds accelerate's ``GradientAccumulationPlugin(**gradient_accumulation_kwargs)`` and skips ``no_sync`` when
    the plugin's ``sync_each_batch`` is set (transformers ``Trainer.create_accelerator_and_postprocess`` and
    ``_inner_training_loop``), so no unsharded gradient outlives its micro-batch."""
    return {"gradient_accumulation_kwargs": {"sync_each_batch": True}}


def _deepspeed_args(layout: Layout, features: LibraryFeatures, engine: dict[str, Any]) -> dict[str, Any]:
    out = {"deepspeed": deepspeed_config(layout, **engine), **_checkpointing(layout, features)}
    if layout.sp_size > 1:
        out["parallelism_config"] = parallelism_kwargs(layout)
    return out


def _ddp_args(layout: Layout, features: LibraryFeatures) -> dict[str, Any]:
    out = {"ddp_find_unused_parameters": False, **_checkpointing(layout, features)}
    if layout.tp_size > 1:
        if layout.dp_replicate_size > 1:
            raise ValueError(
                f"tp_size {layout.tp_size} with ddp over {layout.world_size} ranks: accelerate composes TP only with "
                f"sharded data parallelism ({layout.dp_replicate_size} DDP replicas x tp {layout.tp_size} is refused "
                "by ParallelismConfig); use fsdp_full_shard for FSDP2 x TP, or tp_size = world_size"
            )
        out["parallelism_config"] = parallelism_kwargs(layout)
    return {**out, **_sharded_at_load(layout)}


def _sharded_at_load(layout: Layout) -> dict[str, Any]:
    """A model that transformers shards at load (``tp_plan``) can only checkpoint its weights through the Trainer:
    it refuses to save its optimizer state and to resume it ("Resuming is not supported for models sharded at
    load time"), unless ``save_only_model=True``. hf_dist's ``ShardedResumeCallback`` saves the optimizer."""
    return {"save_only_model": True} if shards_at_load(from_pretrained_kwargs(layout)) else {}


SP_ATTN_IMPLEMENTATION = "sdpa"  # DeepSpeedSequenceParallelConfig(sp_attn_implementation=...): must match the model's


def _model_parallel(layout: Layout) -> bool:
    return layout.tp_size * layout.cp_size * layout.sp_size > 1


def parallelism_kwargs(layout: Layout) -> dict[str, Any]:
    """accelerate ``ParallelismConfig`` kwargs of a layout, as plain data.

    Data-parallel sizes always (HSDP: replicate across nodes, shard within one); ``tp_size``/``cp_size``/``sp_size``
    when > 1. Sequence parallelism adds ``sp_backend="deepspeed"`` and ``sp_attn_implementation`` (the attention
    DeepSpeed's Ulysses wraps; ``hf_dist.auto_args`` turns it into the ``DeepSpeedSequenceParallelConfig`` handler,
    the accelerate YAML writes it as ``parallelism_config_sp_attn_implementation``). TP under DeepSpeed is AutoTP,
    configured in the DeepSpeed JSON, not here.
    """
    out: dict[str, Any] = {"dp_replicate_size": layout.dp_replicate_size, "dp_shard_size": layout.dp_shard_size}
    if layout.tp_size > 1 and not layout.strategy.is_deepspeed:
        out["tp_size"] = layout.tp_size
    if layout.cp_size > 1:
        out["cp_size"] = layout.cp_size
    if layout.sp_size > 1:
        out.update(sp_size=layout.sp_size, sp_backend="deepspeed", sp_attn_implementation=SP_ATTN_IMPLEMENTATION)
    return out


def from_pretrained_kwargs(layout: Layout, features: LibraryFeatures = NEWEST_TESTED_FEATURES) -> dict[str, Any]:
    """What ``AutoModelForCausalLM.from_pretrained`` needs for the layout: under tensor parallelism with DDP or FSDP2,
    transformers shards the model as it loads, with the model's own ``base_model_tp_plan``. Where ``features`` say
    transformers takes a ``DistributedConfig`` for it, that names every size of the layout (``tp_size``, and under
    FSDP2 ``fsdp_size`` and ``dp_replicate_size``, with FSDP2's mixed-precision policy): transformers then applies
    FSDP2 itself at load, on the same ``(dp_replicate, fsdp, tp)`` mesh as the Trainer's ``ParallelismConfig``.
    ``{"tp_plan": "auto"}`` alone would spread TP over every rank (``tp_size`` defaults to ``WORLD_SIZE``), so each
    data-parallel rank's batch would feed one TP group. Older versions take ``tp_plan="auto"``, TP across every
    rank, which :func:`hf_dist.planning.features.check_features` allows only without data-parallel ranks.
    ``attn_implementation``: the attention DeepSpeed's Ulysses wraps under sequence parallelism. DeepSpeed AutoTP
    shards the plain model itself, so it needs nothing at load. ``hf_dist.from_pretrained_kwargs`` is this for the
    installed versions.
    """
    return load_kwargs(
        layout.tp_size, layout.sp_size, deepspeed=layout.strategy.is_deepspeed, features=features,
        fsdp_size=layout.dp_shard_size * layout.cp_size, replicate_size=layout.dp_replicate_size,
        fsdp_mixed_precision=layout.mixed_precision != "no" and not layout.pure_bf16,
    )  # fmt: skip


def load_kwargs(
    tp_size: int,
    sp_size: int,
    *,
    deepspeed: bool,
    features: LibraryFeatures = NEWEST_TESTED_FEATURES,
    fsdp_size: int = 1,
    replicate_size: int = 1,
    fsdp_mixed_precision: bool = False,
) -> dict[str, Any]:
    """:func:`from_pretrained_kwargs` from the sizes alone (what a ``TrainingArguments.parallelism_config`` holds)."""
    out: dict[str, Any] = {}
    if tp_size > 1 and not deepspeed and not features.tp_distributed_config:
        out["tp_plan"] = "auto"
    elif tp_size > 1 and not deepspeed:
        # a plain dict: transformers builds its DistributedConfig at load, in the rank
        config: dict[str, Any] = {"tp_plan": "auto", "tp_size": tp_size}
        if fsdp_size * replicate_size > 1:
            config.update(fsdp_size=fsdp_size, dp_replicate_size=replicate_size)
            config.update({"fsdp_mixed_precision": True} if fsdp_mixed_precision else {})
        out["distributed_config"] = config
    if sp_size > 1:
        out["attn_implementation"] = SP_ATTN_IMPLEMENTATION
    return out


def shards_at_load(load: dict[str, Any]) -> bool:
    """Whether ``from_pretrained`` keywords (:func:`from_pretrained_kwargs`) make transformers shard the model as it
    loads (tensor parallelism): such a model must be loaded from a folder, and its optimizer is hf_dist's to save."""
    return "tp_plan" in load or "tp_plan" in (load.get("distributed_config") or {})


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


def lr_args(request: Request, mbs: int, gas: int, plan: Any, features: LibraryFeatures) -> dict[str, Any]:
    """``learning_rate`` scaled to the global batch (``lr_scaling=``) and a default warmup; {} when not asked."""
    own, user = request.own, request.user
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
    global_batch = mbs * gas * int(plan.layout.dp_size)  # tp/cp/sp ranks share their micro-batch
    out: dict[str, Any] = {"learning_rate": scaled_learning_rate(user.pop("learning_rate"), global_batch, ref, rule)}
    if not any(k in user for k in ("warmup_ratio", "warmup_steps")):
        # transformers 5.x dropped warmup_ratio; a float warmup_steps in [0, 1) is a ratio there.
        key = "warmup_ratio" if features.warmup_ratio_field else "warmup_steps"
        out[key] = DEFAULT_WARMUP_RATIO
    return out
