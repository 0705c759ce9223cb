"""FSDP settings in the form ``transformers.TrainingArguments`` takes (``fsdp`` + ``fsdp_config``).

FSDP2 (``torch.distributed.fsdp.fully_shard``) is the default. FSDP1 is emitted only for a stack that
cannot run FSDP2 (``LibraryFeatures.fsdp_version``, probed by ``hf_dist.planning.features.installed_features``).

Mixed precision, what really happens (transformers 5.x, accelerate 1.x, FSDP2):

* ``bf16=True`` makes accelerate build ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
  output_dtype=bf16)`` and upcast trainable parameters to fp32, so the sharded master weights and
  the optimizer step are fp32 and forward/backward compute is bf16 — but the gradient
  reduce-scatter runs in **bf16**. Neither ``fsdp_config`` nor the accelerate YAML has a key for
  the reduce dtype.
* For an fp32 reduction, call :func:`apply_fp32_reduce` on the constructed ``TrainingArguments``
  (before building the ``Trainer``), or build the plugin yourself with
  ``FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(...))``. accelerate keeps a policy that is
  already set instead of overriding it from ``mixed_precision``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_dist.configs.from_layout import FSDP_FIELDS, layout_kwargs
from hf_dist.planning.features import NEWEST_TESTED_FEATURES, LibraryFeatures
from hf_dist.planning.layout import MIXED_PRECISIONS, Engine, Layout, by_engine
from hf_dist.planning.layout import strategy as registry_entry
from hf_dist.validation import check_choice

__all__ = ["fsdp_config", "fsdp_plugin_kwargs", "apply_fp32_reduce", "mixed_precision_policy"]

# Sharded checkpoints: each rank writes its own shard (fast, no rank-0 gather of the full model);
# `hf-dist convert` turns them back into an HF folder.
DEFAULT_STATE_DICT_TYPE = "SHARDED_STATE_DICT"
DEFAULT_MIXED_PRECISION = "bf16"
FSDP_STRATEGIES = tuple(s.name for s in by_engine(Engine.FSDP2))


def fsdp_config(
    strategy: str | Layout,
    *,
    wrap_classes: Sequence[str] | None = None,
    activation_checkpointing: bool = False,
    offload: str = "none",
    mixed_precision: str = DEFAULT_MIXED_PRECISION,
    state_dict_type: str = DEFAULT_STATE_DICT_TYPE,
    cpu_ram_efficient_loading: bool = True,
    features: LibraryFeatures = NEWEST_TESTED_FEATURES,
) -> dict[str, Any]:
    """``{"fsdp": ..., "fsdp_config": {...}}`` for ``TrainingArguments``.

    ``strategy``: ``fsdp_full_shard`` (reshard after forward), ``fsdp_shard_grad_op`` (keep the
    gathered parameters until backward: faster, more memory) or ``hsdp`` (shard inside a node, replicate
    across nodes: its ``parallelism_config`` comes from :func:`hf_dist.configs.training_args.strategy_args`).
    ``offload`` other than ``"none"`` turns on FSDP CPU offload, which always moves parameters, gradients
    and the optimizer step together. ``mixed_precision`` is validated here but set through ``bf16``/``fp16``
    on ``TrainingArguments``. ``features``: what the installed libraries accept
    (``hf_dist.planning.features.installed_features()``; default: the newest tested versions).

    ``strategy`` may be a :class:`~hf_dist.planning.layout.Layout` (``plan.layout``): its offload, activation
    checkpointing and precision are used (:mod:`hf_dist.configs.from_layout`). These are FSDP's keys of the layout;
    its mesh (``parallelism_config``) and ``sync_each_batch`` come from
    :func:`hf_dist.configs.training_args.strategy_args`.
    """
    if isinstance(strategy, Layout):
        held = layout_kwargs(fsdp_config, strategy, locals(), FSDP_FIELDS)
        rest = {"state_dict_type": state_dict_type, "cpu_ram_efficient_loading": cpu_ram_efficient_loading}
        return fsdp_config(strategy.strategy.name, wrap_classes=wrap_classes, **held, **rest, features=features)
    check_choice("FSDP strategy", strategy, FSDP_STRATEGIES, "DDP and ZeRO strategies are not FSDP.")
    s = registry_entry(strategy)
    check_choice(
        f"offload for {s.name}",
        offload,
        s.offloads,
        "FSDP offloads parameters, gradients and the optimizer step together; for optimizer-only offload use zero2/zero3.",
    )
    check_choice("mixed_precision", mixed_precision, MIXED_PRECISIONS)
    version = features.fsdp_version
    cfg: dict[str, Any] = {
        "version": version,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        # FSDP2: HSDP is full sharding on the intra-node mesh dimension; FSDP1 names the mode
        "reshard_after_forward": not s.gathers_params if version == 2 else s.fsdp_mode,
        "activation_checkpointing": bool(activation_checkpointing),
        "cpu_ram_efficient_loading": bool(cpu_ram_efficient_loading),
        "state_dict_type": state_dict_type,
        "cpu_offload": offload != "none",
    }
    if wrap_classes:
        cfg["transformer_layer_cls_to_wrap"] = list(wrap_classes)
    if version == 1:
        cfg.update({"backward_prefetch": "BACKWARD_PRE", "use_orig_params": True, "sync_module_states": True})
    if features.fsdp_flag_takes_bool:
        flag: bool | str = True
    else:
        flag = " ".join([s.fsdp_mode, "auto_wrap"] + (["offload"] if offload != "none" else []))
    return {"fsdp": flag, "fsdp_config": cfg}


def mixed_precision_policy(mixed_precision: str = "bf16", *, reduce_dtype: str = "fp32") -> dict[str, Any] | None:
    """FSDP2 ``MixedPrecisionPolicy`` kwargs as a dict accelerate's plugin accepts (torch dtypes).

    bf16: parameters gathered and computed in bf16, outputs bf16, gradients reduced in ``reduce_dtype``.
    Returns None for ``"no"`` (full fp32).
    """
    import torch

    check_choice("mixed_precision", mixed_precision, MIXED_PRECISIONS)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    check_choice("reduce_dtype", reduce_dtype, tuple(dtypes))
    if mixed_precision == "no":
        return None
    compute = dtypes[mixed_precision]
    return {"param_dtype": compute, "reduce_dtype": dtypes[reduce_dtype], "output_dtype": compute}


def fsdp_plugin_kwargs(strategy: str, *, reduce_dtype: str = "fp32", **options: Any) -> dict[str, Any]:
    """Kwargs for ``accelerate.utils.FullyShardedDataParallelPlugin`` (FSDP2) with an explicit fp32 reduce.

    ``options``: :func:`fsdp_config`'s keyword arguments (``wrap_classes``, ``activation_checkpointing``,
    ``offload``, ``mixed_precision``, ``state_dict_type``...), except ``features``: the plugin is FSDP2's.
    """
    if "features" in options:
        raise TypeError("fsdp_plugin_kwargs() builds accelerate's FSDP2 plugin and takes no 'features'")
    cfg = fsdp_config(strategy, features=NEWEST_TESTED_FEATURES, **options)["fsdp_config"]
    mixed_precision = options.get("mixed_precision", DEFAULT_MIXED_PRECISION)
    kwargs: dict[str, Any] = {
        "fsdp_version": 2,
        "auto_wrap_policy": "transformer_based_wrap",
        "reshard_after_forward": cfg["reshard_after_forward"],
        "activation_checkpointing": cfg["activation_checkpointing"],
        "cpu_ram_efficient_loading": cfg["cpu_ram_efficient_loading"],
        "state_dict_type": cfg["state_dict_type"],
        "cpu_offload": cfg["cpu_offload"],
        "mixed_precision_policy": mixed_precision_policy(mixed_precision, reduce_dtype=reduce_dtype),
    }
    if "transformer_layer_cls_to_wrap" in cfg:
        kwargs["transformer_cls_names_to_wrap"] = cfg["transformer_layer_cls_to_wrap"]
    return kwargs


def apply_fp32_reduce(training_args: Any, mixed_precision: str | None = None) -> Any:
    """Make the Trainer's FSDP2 plugin reduce gradients in fp32 (bf16/fp16 compute unchanged).

    Call after ``TrainingArguments(...)`` and before ``Trainer(...)``: the Trainer builds its
    ``FullyShardedDataParallelPlugin`` from ``training_args.fsdp_plugin_args``. A no-op (returns the
    args unchanged) when FSDP is off, FSDP1 is used, or no mixed precision is enabled.
    """
    plugin_args = getattr(training_args, "fsdp_plugin_args", None)
    if not plugin_args or int(plugin_args.get("fsdp_version", 1)) != 2:
        return training_args
    if mixed_precision is None:
        mixed_precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no"
    policy = mixed_precision_policy(mixed_precision, reduce_dtype="fp32")
    if policy is not None:
        plugin_args["mixed_precision_policy"] = policy
    return training_args
