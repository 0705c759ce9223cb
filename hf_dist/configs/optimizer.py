"""The planned optimizer as the Trainer's ``optim=``, and the ``optim`` values that run the optimizer the plan counts.

The planner sizes optimizer state for three optimizers (``hf_dist.planning.memory.OPTIMIZERS``): ``adamw`` (two fp32
moments), ``adamw_8bit`` (bitsandbytes, two 8-bit moments) and ``sgd`` (one momentum at most). ``auto_args`` emits
``optim=`` for the plan's, so the Trainer builds what the memory estimate assumed; a user ``optim`` that runs another
optimizer is a contradiction (:func:`optim_conflicts`), and so is a layout under which another one would run. Pure.
"""

from __future__ import annotations

from typing import Any

from hf_dist.planning.features import LibraryFeatures
from hf_dist.planning.layout import strategy

__all__ = ["OPTIM_NAMES", "trainer_optim", "optimizer_of_optim", "optim_conflicts"]

# transformers' OptimizerNames values that run each planned optimizer with the state the plan counts; the first is
# what auto_args emits (for adamw: the TrainingArguments default, fused on torch >= 2.8; LibraryFeatures.default_adamw)
OPTIM_NAMES: dict[str, tuple[str, ...]] = {
    "adamw": ("adamw_torch_fused", "adamw_torch"),
    "adamw_8bit": ("adamw_bnb_8bit", "adamw_8bit"),
    "sgd": ("sgd",),
}


def trainer_optim(optimizer: str, features: LibraryFeatures) -> str:
    """The ``optim=`` that runs ``optimizer`` (a planned name) under the Trainer."""
    if optimizer not in OPTIM_NAMES:
        raise ValueError(
            f"optimizer {optimizer!r} has no Trainer optim= hf_dist can set; the planned optimizers are "
            f"{sorted(OPTIM_NAMES)}."
        )
    return features.default_adamw if optimizer == "adamw" else OPTIM_NAMES[optimizer][0]


def optimizer_of_optim(optim: Any) -> str | None:
    """The planned optimizer an ``optim`` value (string or ``OptimizerNames``) runs, or None for any other."""
    name = str(getattr(optim, "value", optim))
    return next((planned for planned, names in OPTIM_NAMES.items() if name in names), None)


def optim_conflicts(plan: Any, final: dict[str, Any], *, cpu_adam: bool) -> list[str]:
    """``optim`` that runs another optimizer than the plan's, and layouts under which another one would run."""
    planned, out = plan.optimizer, []
    given = final.get("optim")
    if given is not None and optimizer_of_optim(given) != planned:
        name = str(getattr(given, "value", given))
        known = ", ".join(f"{p} ({'/'.join(n)})" for p, n in OPTIM_NAMES.items())
        out.append(
            f"optim={name!r} contradicts the plan's optimizer {planned!r} (optim={OPTIM_NAMES[planned][0]!r}): its "
            f"state was sized for {planned}. hf_dist plans {known}; pass optimizer=<one of them> to auto_args so the "
            "plan counts its state, or drop optim=."
        )
    return out + _offloaded_step(plan, cpu_adam)


def _offloaded_step(plan: Any, cpu_adam: bool) -> list[str]:
    """Offload steps the optimizer on the CPU: ZeRO swaps a torch optimizer for DeepSpeedCPUAdam (accelerate's
    ``map_pytorch_optim_to_deepspeed``) unless ``cpu_adam=False``; bitsandbytes' 8-bit kernels need the GPU."""
    s, planned = strategy(plan.strategy), plan.optimizer
    if planned == "adamw_8bit" and (plan.offload != "none" or plan.hardware.device != "cuda"):
        where = f"offload={plan.offload!r}" if plan.offload != "none" else "CPU hardware"
        return [
            f"optimizer='adamw_8bit' with {where}: bitsandbytes' 8-bit AdamW steps on a CUDA GPU, but the optimizer "
            "step would run on the CPU. Pass offload='none' on GPUs, or optimizer='adamw'."
        ]
    if planned == "sgd" and s.is_deepspeed and plan.offload != "none" and cpu_adam:
        return [
            f"optimizer='sgd' with {plan.strategy} offload={plan.offload!r}: accelerate replaces the offloaded "
            "optimizer with DeepSpeedCPUAdam, so Adam (two moments) would run, not sgd. Pass cpu_adam=False to keep "
            "torch's SGD, or optimizer='adamw'."
        ]
    return []
