"""The one validation step of ``auto_args``: every way the final ``TrainingArguments`` kwargs can contradict the
plan, collected and reported at once (:func:`hf_dist.validation.raise_contradictions`).

It runs after the user's fields are merged into the generated ones and before anything touches the model, so a
contradiction never leaves a half-prepared run. The conflicts found earlier while sorting the keywords
(:mod:`hf_dist.configs.request`) and merging the engine configs (:mod:`hf_dist.configs.overrides`) come in as lists
and are reported here with the rest.
"""

from __future__ import annotations

from typing import Any

from hf_dist.configs.optimizer import optim_conflicts
from hf_dist.configs.request import Request
from hf_dist.configs.training_args import precision_args
from hf_dist.planning.features import LibraryFeatures
from hf_dist.planning.layout import strategy
from hf_dist.validation import raise_contradictions

__all__ = ["validate", "contradictions"]

# DeepSpeed fields of an accelerate launcher config that clash with a DeepSpeed JSON passed to the Trainer
LAUNCHER_DS_CLASHES = ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps")


def validate(plan: Any, request: Request, final: dict[str, Any], **context: Any) -> None:
    """Raise one ValueError listing every contradiction (:func:`contradictions`, same arguments), or return."""
    raise_contradictions(contradictions(plan, request, final, **context))


def contradictions(
    plan: Any,
    request: Request,
    final: dict[str, Any],
    *,
    merge_conflicts: list[str],
    features: LibraryFeatures,
    launcher_ds_fields: str = "",
    cpu_ranks: int = 0,
    engine_on_cpu: bool = False,
) -> list[str]:
    """Every contradiction between ``request``, ``plan`` and the ``final`` kwargs, one message (with its fix) each.

    The launch comes in as plain values: ``launcher_ds_fields`` (an accelerate launcher config's DeepSpeed fields),
    ``cpu_ranks`` (the ranks of a launch without CUDA, 0 otherwise) and ``engine_on_cpu`` (FSDP2 / DeepSpeed opted in
    for CPU ranks: ``auto_args(engine_on_cpu=True)``, or FSDP on CPU already enabled)."""
    return [
        *request.conflicts,
        *merge_conflicts,
        *_batch(plan, request),
        *_precision(plan, request, final),
        *optim_conflicts(plan, final, cpu_adam=request.cpu_adam),
        *_activation_checkpointing(plan, request.user, features),
        *_engines(plan, final),
        *_launcher(final, launcher_ds_fields),
        *_cpu_engine(plan, cpu_ranks, engine_on_cpu),
    ]


def _batch(plan: Any, request: Request) -> list[str]:
    """A user ``gradient_accumulation_steps`` must still give the global batch the user asked the plan for: micro-batch
    x accumulation x the data-parallel ranks (tensor, context and sequence parallel ranks share their micro-batch);
    without a global batch asked for it must be the plan's (``auto_args`` plans it; a ``plan=`` is as given)."""
    gas = request.user.get("gradient_accumulation_steps")
    if gas is None:
        return []
    mbs, dp = int(plan.micro_batch_size), int(plan.layout.dp_size)
    if "global_batch_size" not in request.plan_kwargs:
        if gas == plan.gradient_accumulation_steps:
            return []
        return [
            f"gradient_accumulation_steps={gas} contradicts the plan, which accumulates "
            f"{plan.gradient_accumulation_steps} step(s) of micro-batch {mbs} (global batch "
            f"{plan.global_batch_size}); drop it, or plan with global_batch_size={mbs * gas * dp} (gradients kept "
            "across micro-batches cost memory)."
        ]
    if mbs * gas * dp == plan.global_batch_size:
        return []
    ranks = "world_size" if dp == plan.world_size else "data_parallel"
    return [
        f"per_device_train_batch_size({mbs}) * gradient_accumulation_steps({gas}) * {ranks}({dp}) "
        f"= {mbs * gas * dp} != global_batch_size({plan.global_batch_size}); "
        "drop one of them or make the product match."
    ]


_PRECISION_TEXT = {"bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision", "no": "fp32"}


def _precision(plan: Any, request: Request, final: dict[str, Any]) -> list[str]:
    """``bf16`` / ``fp16`` as the plan states them (activations, logits and engine buffers were sized for its
    precision); pure bf16's flags and optimizer as it needs them."""
    planned, user = precision_args(plan), request.user
    if user.get("bf16") and user.get("fp16"):
        flags = f"bf16={planned['bf16']}, fp16={planned['fp16']}"
        return [f"bf16=True and fp16=True are both set; pass only one (the plan's: {flags})."]
    checked = ("fp16",) if plan.pure_bf16 else ("bf16", "fp16")  # pure bf16's bf16 flag: _pure_bf16 says why
    out = [
        _precision_message(plan, flag, user[flag], planned)
        for flag in checked
        if flag in user and bool(user[flag]) != planned[flag]
    ]
    return out + _pure_bf16(plan, request, final)


def _precision_message(plan: Any, flag: str, value: Any, planned: dict[str, bool]) -> str:
    """One precision flag the user set against the plan: both values and the fix."""
    hardware = plan.hardware.gpu_name or plan.hardware.device
    if flag == "bf16" and value and plan.mixed_precision == "fp16":
        return (
            f"bf16=True but the hardware ({hardware}) has no bf16 support; use fp16=True (the plan's choice) or "
            "drop bf16."
        )
    chosen = "pure bf16" if plan.pure_bf16 else _PRECISION_TEXT[plan.mixed_precision]
    return (
        f"{flag}={value!r} contradicts the plan, which trains in {chosen} on this hardware ({hardware}: "
        f"bf16={planned['bf16']}, fp16={planned['fp16']}); activations, logits and the engine's buffers were sized "
        f"for it. Drop {flag}= (auto_args sets both flags from the hardware)."
    )


def _pure_bf16(plan: Any, request: Request, final: dict[str, Any]) -> list[str]:
    """Pure bf16: FSDP2 runs with bf16=False (accelerate would upcast to fp32), the others with bf16=True; DeepSpeed
    keeps offloaded bf16 optimizer state only in DeepSpeedCPUAdam."""
    if not plan.pure_bf16:
        return []
    out = []
    bf16, fsdp = bool(final.get("bf16")), strategy(plan.strategy).is_fsdp
    if fsdp and bf16:
        out.append(
            f"pure_bf16=True with {plan.strategy} needs bf16=False: with bf16=True accelerate upcasts the sharded "
            "parameters to fp32 (fp32 master weights and Adam state). Drop bf16=True; the model's own bf16 "
            "weights set the compute dtype."
        )
    if not fsdp and not bf16:
        out.append(
            f"pure_bf16=True with {plan.strategy} needs bf16=True, got bf16={final.get('bf16')!r}; drop bf16=False."
        )
    if strategy(plan.strategy).is_deepspeed and plan.offload != "none" and not request.cpu_adam:
        out.append(
            f"pure_bf16=True with {plan.strategy} offload={plan.offload!r} needs DeepSpeedCPUAdam (DeepSpeed asserts "
            "otherwise), but cpu_adam=False; pass cpu_adam=True, or drop pure_bf16 to keep fp32 optimizer state."
        )
    return out


def _activation_checkpointing(plan: Any, user: dict[str, Any], features: LibraryFeatures) -> list[str]:
    """Checkpointing is planned (memory and speed): under FSDP it goes to ``fsdp_config``; elsewhere the flag must
    say what the plan says."""
    ac_flag = features.activation_checkpointing_field
    fsdp = strategy(plan.strategy).is_fsdp
    if fsdp and (user.get(ac_flag) or user.get("gradient_checkpointing")):
        return [
            f"{ac_flag}=True with FSDP ({plan.strategy}) checkpoints through the model and adds a redundant "
            "all-gather; pass activation_checkpointing=True to auto_args (planner keyword) so it goes to fsdp_config."
        ]
    given = {k: user[k] for k in {ac_flag, "gradient_checkpointing"} if k in user}
    planned = bool(plan.activation_checkpointing)
    if fsdp or all(bool(v) == planned for v in given.values()):
        return []
    return [
        f"{given} contradicts the plan, which {'checkpoints' if planned else 'does not checkpoint'} activations "
        f"(memory and speed were planned for it); pass activation_checkpointing={not planned} to auto_args "
        "(planner keyword) so the plan accounts for it."
    ]


def _engines(plan: Any, final: dict[str, Any]) -> list[str]:
    """One engine: FSDP and DeepSpeed cannot both be on."""
    if final.get("fsdp") and final.get("deepspeed"):
        return [
            f"fsdp and deepspeed are both set (the plan chose {plan.strategy}); choose one strategy "
            "(strategy='zero3' or 'fsdp_full_shard')."
        ]
    return []


def _launcher(final: dict[str, Any], launcher_ds_fields: str) -> list[str]:
    """accelerate refuses a DeepSpeed JSON when its launcher config already sets these DeepSpeed fields."""
    clashing = sorted(set(LAUNCHER_DS_CLASHES) & set(launcher_ds_fields.split(",")))
    if not (final.get("deepspeed") and clashing):
        return []
    return [
        "auto_args chose DeepSpeed, but this process was launched with an accelerate DeepSpeed config that sets "
        f"{clashing}; accelerate refuses both. Launch with accelerate_configs/ddp.yaml or torchrun (auto_args "
        "supplies the DeepSpeed JSON)."
    ]


def _cpu_engine(plan: Any, cpu_ranks: int, engine_on_cpu: bool) -> list[str]:
    """FSDP2 or ZeRO on CPU ranks runs only when opted in: accelerate drops FSDP on CPU (plain DDP trains instead) and
    sets DeepSpeed up for a single rank there (``hf_dist.runtime.cpu_fsdp``)."""
    s = strategy(plan.strategy)
    if cpu_ranks < 2 or engine_on_cpu or not (s.is_fsdp or s.is_deepspeed):
        return []
    if s.is_fsdp:
        why = "accelerate silently drops FSDP on CPU and would train plain DDP (full weights and optimizer per rank)"
        how = "turns FSDP2 on for CPU ranks (hf_dist.runtime.cpu_fsdp.enable_fsdp_on_cpu; recipes: pass --fsdp_on_cpu)"
    else:
        why = "accelerate sets DeepSpeed up for a single rank without CUDA (DeepSpeed's batch check then fails)"
        how = (
            "adds the kwargs of hf_dist.runtime.cpu_fsdp.cpu_deepspeed_training_kwargs() and starts DeepSpeed's "
            "process group over gloo (recipes: pass --deepspeed_on_cpu)"
        )
    return [
        f"strategy {plan.strategy!r} on {cpu_ranks} CPU ranks: {why}. For tests and CPU development call "
        f"hf_dist.auto_args(model, ..., engine_on_cpu=True), which {how}; otherwise plan DDP with strategy='ddp', "
        "or train on GPUs."
    ]
