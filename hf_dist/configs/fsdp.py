"""FSDP settings in the form ``transformers.TrainingArguments`` takes (``fsdp`` + ``fsdp_config``).

FSDP2 (``torch.distributed.fsdp.fully_shard``) is the default. FSDP1 is emitted only when the
installed stack cannot run FSDP2 (see :func:`installed_fsdp_version`).

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

from hf_dist.configs import ALLOWED_OFFLOADS, FSDP_STRATEGIES, MIXED_PRECISIONS, check_choice

__all__ = [
    "fsdp_config",
    "fsdp_plugin_kwargs",
    "apply_fp32_reduce",
    "installed_fsdp_version",
    "mixed_precision_policy",
]

# Sharded checkpoints: each rank writes its own shard (fast, no rank-0 gather of the full model);
# `hf-dist convert` turns them back into an HF folder.
DEFAULT_STATE_DICT_TYPE = "SHARDED_STATE_DICT"


def installed_fsdp_version() -> int:
    """2 when the installed torch/accelerate/transformers can run FSDP2 through the Trainer, else 1 (probed)."""
    import dataclasses

    try:
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2's entry point)
    except ImportError:
        return 1
    plugin_fields = {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}
    return 2 if "fsdp_version" in plugin_fields and _trainer_reads_fsdp_version() else 1


def _trainer_reads_fsdp_version() -> bool:
    """Whether ``TrainingArguments`` forwards ``fsdp_config["version"]`` to accelerate (every transformers 5.x)."""
    import inspect

    from transformers import TrainingArguments

    process = getattr(TrainingArguments, "_process_fsdp_args", None) or TrainingArguments.__post_init__
    try:
        source = inspect.getsource(process)
    except (OSError, TypeError):  # no source on disk (frozen install): every supported transformers forwards it
        return True
    return '"version"' in source or "'version'" in source


def _fsdp_flag_takes_bool() -> bool:
    """Newer transformers 5.x want ``fsdp=True`` (strings/lists are deprecated); 5.0 wants the string form."""
    from transformers import TrainingArguments

    return hasattr(TrainingArguments, "_apply_legacy_fsdp_to_config")


def fsdp_config(
    strategy: str,
    *,
    wrap_classes: Sequence[str] | None = None,
    activation_checkpointing: bool = False,
    offload: str = "none",
    mixed_precision: str = "bf16",
    state_dict_type: str = DEFAULT_STATE_DICT_TYPE,
    cpu_ram_efficient_loading: bool = True,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    version: int | None = None,
) -> dict[str, Any]:
    """``{"fsdp": ..., "fsdp_config": {...}}`` (plus ``parallelism_config`` for HSDP) for ``TrainingArguments``.

    ``strategy``: ``fsdp_full_shard`` (reshard after forward), ``fsdp_shard_grad_op`` (keep the
    gathered parameters until backward: faster, more memory) or ``hsdp`` (shard inside a node,
    replicate across ``nodes``; needs ``gpus_per_node``). ``offload`` other than ``"none"`` turns on
    FSDP CPU offload, which always moves parameters, gradients and the optimizer step together.
    ``mixed_precision`` is validated here but set through ``bf16``/``fp16`` on ``TrainingArguments``.
    """
    check_choice("FSDP strategy", strategy, FSDP_STRATEGIES, "DDP and ZeRO strategies are not FSDP.")
    check_choice(
        f"offload for {strategy}",
        offload,
        ALLOWED_OFFLOADS[strategy],
        "FSDP offloads parameters, gradients and the optimizer step together; for optimizer-only offload use zero2/zero3.",
    )
    check_choice("mixed_precision", mixed_precision, MIXED_PRECISIONS)
    version = installed_fsdp_version() if version is None else version
    if version not in (1, 2):
        raise ValueError(f"FSDP version must be 1 or 2, got {version!r}.")

    cfg: dict[str, Any] = {
        "version": version,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "reshard_after_forward": _reshard_after_forward(strategy, version),
        "activation_checkpointing": bool(activation_checkpointing),
        "cpu_ram_efficient_loading": bool(cpu_ram_efficient_loading),
        "state_dict_type": state_dict_type,
        "cpu_offload": offload != "none",
    }
    if wrap_classes:
        cfg["transformer_layer_cls_to_wrap"] = list(wrap_classes)
    if version == 1:
        cfg.update({"backward_prefetch": "BACKWARD_PRE", "use_orig_params": True, "sync_module_states": True})

    out: dict[str, Any] = {"fsdp": _fsdp_flag(strategy, offload), "fsdp_config": cfg}
    if strategy == "hsdp" and version == 2:
        out["parallelism_config"] = hsdp_parallelism_config(nodes, gpus_per_node)
    return out


def _reshard_after_forward(strategy: str, version: int) -> bool | str:
    if version == 2:
        if strategy == "hsdp":
            return True  # HSDP in FSDP2 is full sharding on the intra-node mesh dimension
        return strategy == "fsdp_full_shard"
    return {"fsdp_full_shard": "full_shard", "fsdp_shard_grad_op": "shard_grad_op", "hsdp": "hybrid_shard"}[strategy]


def _fsdp_flag(strategy: str, offload: str) -> bool | str:
    if _fsdp_flag_takes_bool():
        return True
    words = [_reshard_after_forward(strategy, 1), "auto_wrap"] + (["offload"] if offload != "none" else [])
    return " ".join(words)  # type: ignore[arg-type]


def hsdp_parallelism_config(nodes: int, gpus_per_node: int | None) -> Any:
    """accelerate ``ParallelismConfig`` for HSDP: replicate across nodes, shard within a node."""
    if not isinstance(nodes, int) or nodes < 2:
        raise ValueError(f"hsdp needs nodes >= 2 (replicate across nodes), got nodes={nodes!r}; use fsdp_full_shard.")
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"hsdp needs gpus_per_node >= 1 (the shard group size), got {gpus_per_node!r}.")
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(dp_replicate_size=nodes, dp_shard_size=gpus_per_node)


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


def fsdp_plugin_kwargs(
    strategy: str,
    *,
    wrap_classes: Sequence[str] | None = None,
    activation_checkpointing: bool = False,
    offload: str = "none",
    mixed_precision: str = "bf16",
    reduce_dtype: str = "fp32",
    state_dict_type: str = DEFAULT_STATE_DICT_TYPE,
) -> dict[str, Any]:
    """Kwargs for ``accelerate.utils.FullyShardedDataParallelPlugin`` (FSDP2) with an explicit fp32 reduce."""
    cfg = fsdp_config(
        strategy,
        wrap_classes=wrap_classes,
        activation_checkpointing=activation_checkpointing,
        offload=offload,
        mixed_precision=mixed_precision,
        state_dict_type=state_dict_type,
        nodes=2 if strategy == "hsdp" else 1,
        gpus_per_node=1,
        version=2,
    )["fsdp_config"]
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
    if wrap_classes:
        kwargs["transformer_cls_names_to_wrap"] = list(wrap_classes)
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
