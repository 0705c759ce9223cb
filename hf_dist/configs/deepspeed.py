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

from hf_dist.configs import DEEPSPEED_STRATEGIES, MIXED_PRECISIONS, OFFLOADS, check_choice
from hf_dist.memory import DS_PREFETCH_BUCKET_ELEMENTS, DS_REDUCE_BUCKET_ELEMENTS

__all__ = ["deepspeed_config", "zero_stage"]


def zero_stage(strategy: str) -> int:
    """``"zero3"`` -> 3."""
    check_choice("DeepSpeed strategy", strategy, DEEPSPEED_STRATEGIES, "DDP and FSDP strategies are not DeepSpeed.")
    return int(strategy[-1])


def deepspeed_config(
    strategy: str,
    *,
    offload: str = "none",
    mixed_precision: str = "bf16",
    cpu_adam: bool = True,
    pure_bf16: bool = False,
) -> dict[str, Any]:
    """DeepSpeed config dict for ``TrainingArguments(deepspeed=...)`` or a JSON file.

    ``offload``: ``"optimizer"`` puts optimizer states (and the optimizer step) on pinned CPU memory
    (ZeRO-Offload, stage >= 1 supported by DeepSpeed, most useful with 2/3); ``"optimizer+params"``
    also offloads parameters and needs ZeRO-3. ``cpu_adam``: see the module docstring. ``mixed_precision``: ``"bf16"`` (no loss scaling
    needed), ``"fp16"`` (dynamic loss scaling, for GPUs without bf16) or ``"no"``. bf16 keeps an fp32
    partition of the master weights with fp32 Adam state; ``pure_bf16=True`` keeps both in bf16
    (``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``, DeepSpeed >= 0.18.5) and accumulates
    gradients in bf16: half the optimizer memory, less accurate updates.
    """
    stage = zero_stage(strategy)
    check_choice("offload", offload, OFFLOADS)
    check_choice("mixed_precision", mixed_precision, MIXED_PRECISIONS)
    if offload == "optimizer+params" and stage != 3:
        raise ValueError(
            f"offload='optimizer+params' needs ZeRO-3 (parameters are only partitioned in stage 3), got {strategy}; "
            "use strategy='zero3' or offload='optimizer'."
        )

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": _zero_section(stage, offload),
        # Accumulate gradients in fp32 across micro-batches even when compute is bf16/fp16.
        "data_types": {"grad_accum_dtype": "fp32"},
        # The Trainer hands DeepSpeed a torch optimizer; allow it instead of refusing.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,  # the Trainer logs; silence DeepSpeed's own step prints
        "wall_clock_breakdown": False,
    }
    if pure_bf16 and mixed_precision != "bf16":
        raise ValueError(
            f"pure_bf16=True keeps bf16 weights and Adam state and needs mixed_precision='bf16', "
            f"got {mixed_precision!r}; use mixed_precision='bf16' or drop pure_bf16."
        )
    cfg.update(_precision_section(mixed_precision, pure_bf16=pure_bf16))
    if pure_bf16:
        # ZeRO-1 with bf16 and fp32 accumulation switches to DeepSpeed's BF16_Optimizer, which always
        # keeps fp32 masters (engine._do_optimizer_sanity_check); bf16 accumulation keeps the ZeRO optimizer
        cfg["data_types"] = {"grad_accum_dtype": "bf16"}
    if offload != "none" and not cpu_adam:
        # Keep the Trainer's torch optimizer on CPU instead of swapping in DeepSpeedCPUAdam.
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


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


def _zero_section(stage: int, offload: str) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": stage >= 2,  # overlap the gradient reduce with backward once gradients are partitioned
        "contiguous_gradients": True,
        "reduce_scatter": True,
        # DeepSpeed's own defaults, written out (the Trainer's "auto" would substitute hidden**2):
        # the planner's memory model counts exactly these buffers (hf_dist.memory, measured in
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
                "stage3_max_live_parameters": 1_000_000_000,
                "stage3_max_reuse_distance": 1_000_000_000,
                "sub_group_size": 1_000_000_000,
                # save_model() writes a consolidated 16-bit model instead of only ZeRO shards
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero
