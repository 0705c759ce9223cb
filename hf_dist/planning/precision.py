"""The precision a plan trains in: the loaded model's dtype, the hardware's mixed precision, and pure bf16's check.

Pure policy over typed inputs, read by the planner; :mod:`hf_dist.runtime.precision` applies it to a loaded model
(upcasts, flags). See that module for what each strategy does with ``bf16=True``.
"""

from __future__ import annotations

import sys
from typing import Any

# dtypes the memory model has byte counts for (hf_dist.planning.memory: param_bytes 2 or 4)
KNOWN_DTYPES = ("float32", "bfloat16", "float16")
# bitsandbytes / quantized parameter classes: their storage is not a trainable float weight
QUANTIZED_PARAM_CLASSES = ("Params4bit", "Int8Params")


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def is_module(model: Any) -> bool:
    """Whether ``model`` is a torch module; torch is not imported to say no (a module means torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def float_params(model: Any):
    """(name, parameter) for floating-point, non-quantized parameters."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and type(param).__name__ not in QUANTIZED_PARAM_CLASSES:
            yield name, param


def loaded_dtype(model: Any) -> str | None:
    """The dtype ``model`` was loaded in (``"bfloat16"``...), or None when it is not a loaded module.

    A name, config or parameter count has no loaded dtype. For a module it is the dtype holding most
    floating-point parameter elements (PEFT adapters in fp32 do not change a bf16 base). Raises
    ValueError when a floating-point parameter has a dtype the memory model does not know.
    """
    if not is_module(model):
        return None
    counts: dict[str, int] = {}
    for name, param in float_params(model):
        dtype = dtype_name(param.dtype)
        if dtype not in KNOWN_DTYPES:
            raise ValueError(
                f"parameter {name!r} is {dtype}; hf_dist plans models loaded in {', '.join(KNOWN_DTYPES)}. "
                "Load the model with dtype=torch.bfloat16 (or torch.float32), or call model.to(torch.bfloat16)."
            )
        counts[dtype] = counts.get(dtype, 0) + param.numel()
    return max(counts, key=counts.get) if counts else None


def check_pure_bf16_hardware(pure_bf16: bool, hw: Any) -> None:
    """Refuse pure bf16 on hardware without bf16 before any training starts."""
    if not isinstance(pure_bf16, bool):
        raise ValueError(f"pure_bf16 must be True or False, got {pure_bf16!r}")
    if pure_bf16 and not hw.bf16:
        where = hw.gpu_name or hw.device
        raise ValueError(
            f"pure_bf16=True needs bf16 support, but the hardware ({where}, bf16={hw.bf16}) has none; "
            "drop pure_bf16 (the plan then keeps fp32 master weights), or describe bf16 hardware with "
            "detect_hardware(bf16=True)."
        )


def hardware_precision(hw: Any) -> tuple[str, int, bool]:
    """(mixed_precision, compute bytes, fp32 master weights) on ``hw``."""
    if hw.bf16:
        return "bf16", 2, True
    if hw.fp16:
        return "fp16", 2, True
    return "no", 4, False
