"""DeepSpeed ZeRO-1/2/3 JSON configs that stay consistent with ``transformers.Trainer``.

Batch size, accumulation, clipping and bucket sizes are ``"auto"``: the Trainer fills them from
``TrainingArguments`` and the model's hidden size, so the two can never disagree. There is no
``optimizer``/``scheduler`` block: the Trainer's torch AdamW and LR schedule are used
(``zero_allow_untested_optimizer``), so the learning rate has a single source of truth
(``TrainingArguments.learning_rate``).

With optimizer offload, accelerate swaps the torch AdamW for DeepSpeedCPUAdam (several times
faster on CPU, but JIT-compiles a C++ op on first use). ``cpu_adam=False`` keeps the torch
optimizer stepping on CPU instead (``zero_force_ds_cpu_optimizer: false``) — slower, no compiler
needed; the CPU test-suite uses it.
"""

from __future__ import annotations

from typing import Any

from hf_dist.configs.from_layout import DEEPSPEED_FIELDS, layout_kwargs
from hf_dist.planning.layout import MIXED_PRECISIONS, OFFLOAD_DEVICES, OFFLOADS, Engine, Layout, by_engine, strategy
from hf_dist.planning.nvme import (
    NVME_OPTIMIZER_BUFFER_COUNT,
    NVME_PARAM_BUFFER_COUNT,
    NVME_PARAM_BUFFER_SIZE,
    NVME_PARAM_MAX_IN_CPU,
    NVME_SUB_GROUP_SIZE,
)
from hf_dist.planning.transients import (
    DS_MAX_LIVE_PARAMETERS,
    DS_PREFETCH_BUCKET_ELEMENTS,
    DS_REDUCE_BUCKET_ELEMENTS,
    DS_SUB_GROUP_ELEMENTS,
)
from hf_dist.validation import check_choice

__all__ = ["deepspeed_config", "zero_stage"]


def zero_stage(strategy_name: str) -> int:
    """``"zero3"`` -> 3."""
    allowed = [s.name for s in by_engine(Engine.DEEPSPEED)]
    check_choice("DeepSpeed strategy", strategy_name, allowed, "DDP and FSDP strategies are not DeepSpeed.")
    return strategy(strategy_name).zero_stage


def deepspeed_config(
    strategy: str | Layout,
    *,
    offload: str = "none",
    mixed_precision: str = "bf16",
    cpu_adam: bool = True,
    pure_bf16: bool = False,
    tp_size: int = 1,
    sp_size: int = 1,
    offload_device: str = "cpu",
    nvme_path: str | None = None,
    nvme_param_buffer: int = NVME_PARAM_BUFFER_SIZE,
) -> dict[str, Any]:
    """DeepSpeed config dict for ``TrainingArguments(deepspeed=...)`` or a JSON file.

    ``offload``: ``"optimizer"`` puts optimizer states (and the optimizer step) on pinned CPU memory
    (ZeRO-Offload, stage >= 1 supported by DeepSpeed, most useful with 2/3); ``"optimizer+params"``
    also offloads parameters and needs ZeRO-3. ``cpu_adam``: see the module docstring. ``mixed_precision``: ``"bf16"`` (no loss scaling
    needed), ``"fp16"`` (dynamic loss scaling, for GPUs without bf16) or ``"no"``. bf16 keeps an fp32
    partition of the master weights with fp32 Adam state; ``pure_bf16=True`` keeps both in bf16
    (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``, DeepSpeed >= 0.18.5) and accumulates
    gradients in bf16: half the optimizer memory, less accurate updates.

    ``tp_size > 1``: DeepSpeed AutoTP, ``"tensor_parallel": {"autotp_size": tp_size}`` (ZeRO <= 2).
    ``sp_size > 1``: DeepSpeed Ulysses, ``"sequence_parallel_size": sp_size`` (accelerate's
    ``ParallelismConfig(sp_backend="deepspeed")`` sets up the attention; DeepSpeed reads the size for ``zero.Init``).
    ``offload_device="nvme"``: ZeRO-Infinity (ZeRO-3): the offloaded states go to ``nvme_path`` (required: a
    folder on a local NVMe drive, one per node) with DeepSpeed's default buffer and ``aio`` settings written out;
    ``nvme_param_buffer``: elements per parameter swap buffer, at least the model's largest parameter partition
    (``auto_args`` passes :func:`hf_dist.planning.model_states.nvme_param_buffer`; the 1e8 default holds any tensor of up
    to 1e8 elements per rank).

    ``strategy`` may be a :class:`~hf_dist.planning.layout.Layout` (``plan.layout``): its offload, precision, sizes and
    offload device are used (:mod:`hf_dist.configs.from_layout`). The JSON is DeepSpeed's part of the layout; its
    ``TrainingArguments`` flags (activation checkpointing, ``parallelism_config``) come from
    :func:`hf_dist.configs.training_args.strategy_args`.
    """
    if isinstance(strategy, Layout):
        held = layout_kwargs(deepspeed_config, strategy, locals(), DEEPSPEED_FIELDS)
        engine = {"cpu_adam": cpu_adam, "nvme_path": nvme_path, "nvme_param_buffer": nvme_param_buffer}
        return deepspeed_config(strategy.strategy.name, **held, **engine)
    stage = zero_stage(strategy)
    _check_offload(strategy, stage, offload, mixed_precision)
    cfg = _base_config(_zero_section(stage, offload, offload_device, nvme_path, nvme_param_buffer))
    if pure_bf16 and mixed_precision != "bf16":
        raise ValueError(
            f"pure_bf16=True keeps bf16 weights and Adam state and needs mixed_precision='bf16', "
            f"got {mixed_precision!r}; use mixed_precision='bf16' or drop pure_bf16."
        )
    cfg.update(_precision_section(mixed_precision, pure_bf16=pure_bf16))
    _check_model_parallel(strategy, tp_size, sp_size)
    cfg.update(_optional_keys(tp_size, sp_size, offload, offload_device, pure_bf16, cpu_adam))
    return cfg


def _check_offload(strategy: str, stage: int, offload: str, mixed_precision: str) -> None:
    check_choice("offload", offload, OFFLOADS)
    check_choice("mixed_precision", mixed_precision, MIXED_PRECISIONS)
    if offload == "optimizer+params" and stage != 3:
        raise ValueError(
            f"offload='optimizer+params' needs ZeRO-3 (parameters are only partitioned in stage 3), got {strategy}; "
            "use strategy='zero3' or offload='optimizer'."
        )


def _base_config(zero_optimization: dict[str, Any]) -> dict[str, Any]:
    """The keys every config has: the Trainer's ``"auto"`` batch settings, the ZeRO section, fp32 accumulation."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero_optimization,
        # Accumulate gradients in fp32 across micro-batches even when compute is bf16/fp16.
        "data_types": {"grad_accum_dtype": "fp32"},
        # The Trainer hands DeepSpeed a torch optimizer; allow it instead of refusing.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,  # the Trainer logs; silence DeepSpeed's own step prints
        "wall_clock_breakdown": False,
    }


def _optional_keys(
    tp_size: int, sp_size: int, offload: str, offload_device: str, pure_bf16: bool, cpu_adam: bool
) -> dict[str, Any]:
    """AutoTP, Ulysses, NVMe async I/O, bf16 accumulation and the Trainer's own CPU optimizer, where asked for."""
    keys: dict[str, Any] = {}
    if tp_size > 1:
        keys["tensor_parallel"] = {"autotp_size": tp_size}
    if sp_size > 1:
        keys["sequence_parallel_size"] = sp_size
    if offload_device == "nvme":
        keys["aio"] = dict(AIO_DEFAULTS)
    if pure_bf16:
        # ZeRO-1 with bf16 and fp32 accumulation switches to DeepSpeed's BF16_Optimizer, which always
        # keeps fp32 masters (engine._do_optimizer_sanity_check); bf16 accumulation keeps the ZeRO optimizer
        keys["data_types"] = {"grad_accum_dtype": "bf16"}  # replaces the fp32 default, in its place
    if offload != "none" and not cpu_adam:
        # Keep the Trainer's torch optimizer on CPU instead of swapping in DeepSpeedCPUAdam.
        keys["zero_force_ds_cpu_optimizer"] = False
    return keys


# DeepSpeed's async-I/O defaults (deepspeed/runtime/swap_tensor/constants.py), written out so the JSON shows them
AIO_DEFAULTS = {
    "block_size": 1048576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
    "use_gds": False,
}


def _check_model_parallel(strategy: str, tp_size: int, sp_size: int) -> None:
    """The planner's own checks (:class:`~hf_dist.planning.layout.Layout`) on the smallest world these sizes run on:
    AutoTP only with ZeRO <= 2, never together with Ulysses."""
    for name, size in (("tp_size", tp_size), ("sp_size", sp_size)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    Layout(strategy, world_size=tp_size * sp_size, tp_size=tp_size, sp_size=sp_size)


def _offload_target(device: str, nvme_path: str | None) -> dict[str, Any]:
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}


def _precision_section(mixed_precision: str, *, pure_bf16: bool = False) -> dict[str, Any]:
    if mixed_precision == "bf16" and pure_bf16:
        bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
        return {"bf16": bf16, "fp16": {"enabled": False}}
    if mixed_precision == "bf16":
        return {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
    if mixed_precision == "fp16":
        return {
            "bf16": {"enabled": False},
            # Dynamic loss scaling (loss_scale 0): start at 2**16, halve on overflow, grow after 1000 clean steps.
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            },
        }
    return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}


def _zero_section(
    stage: int,
    offload: str,
    offload_device: str = "cpu",
    nvme_path: str | None = None,
    nvme_param_buffer: int = NVME_PARAM_BUFFER_SIZE,
) -> dict[str, Any]:
    check_choice("offload_device", offload_device, OFFLOAD_DEVICES)
    if offload_device == "nvme":
        if stage != 3 or offload == "none":
            raise ValueError(
                f"offload_device 'nvme' with ZeRO-{stage} offload={offload!r}: NVMe offload is DeepSpeed "
                "ZeRO-Infinity, which needs zero3 and offload 'optimizer' or 'optimizer+params'"
            )
        if not nvme_path:
            raise ValueError(
                "offload_device 'nvme' needs nvme_path: a writable folder on a local NVMe drive on every node "
                "(e.g. nvme_path='/local_nvme/ds_offload', hf-dist config --nvme-path /local_nvme/ds_offload); "
                f"got {nvme_path!r}"
            )
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": stage >= 2,  # overlap the gradient reduce with backward once gradients are partitioned
        "contiguous_gradients": True,
        "reduce_scatter": True,
        # DeepSpeed's own defaults, written out (the Trainer's "auto" would substitute hidden**2):
        # the planner's memory model counts exactly these buffers (hf_dist.planning.memory, measured in
        # benchmarks/planner_accuracy.py), so the plan and the config agree
        "reduce_bucket_size": DS_REDUCE_BUCKET_ELEMENTS,
    }
    if stage in (1, 2):
        zero["allgather_partitions"] = True
        zero["allgather_bucket_size"] = 200_000_000  # elements (~400 MB in bf16) per all-gather bucket
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": DS_PREFETCH_BUCKET_ELEMENTS,
                "stage3_param_persistence_threshold": "auto",  # 10 * hidden_size: tiny params stay gathered
                "stage3_max_live_parameters": DS_MAX_LIVE_PARAMETERS,  # the gathered elements the plan counts
                "stage3_max_reuse_distance": 1_000_000_000,
                "sub_group_size": NVME_SUB_GROUP_SIZE if offload_device == "nvme" else DS_SUB_GROUP_ELEMENTS,
                # save_model() writes a consolidated 16-bit model instead of only ZeRO shards
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = _offload_target(offload_device, nvme_path)
        if offload_device == "nvme":
            zero["offload_optimizer"].update({"buffer_count": NVME_OPTIMIZER_BUFFER_COUNT, "fast_init": False})
    if offload == "optimizer+params":
        zero["offload_param"] = _offload_target(offload_device, nvme_path)
        if offload_device == "nvme":
            zero["offload_param"].update(
                {
                    "buffer_count": NVME_PARAM_BUFFER_COUNT,
                    "buffer_size": nvme_param_buffer,
                    "max_in_cpu": NVME_PARAM_MAX_IN_CPU,
                }
            )
    return zero
