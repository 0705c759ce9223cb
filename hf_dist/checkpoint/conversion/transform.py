"""Pure transforms between a training checkpoint's tensor names and an HF / PEFT folder's.

Key mapping is data (``WRAPPER_PREFIXES``, ``OUTER_PREFIXES``); functions here take names and
tensors and return names and tensors, without I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Prefixes that wrappers insert into module paths, anywhere in the name (DDP, accelerate's
# DeepSpeed/FSDP wrappers, torch.compile, FSDP1 flat-param and activation-checkpoint wrappers).
WRAPPER_PREFIXES = (
    "_forward_module.",
    "module.",
    "_orig_mod.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
)
# Top-level containers a state dict may be saved under (accelerate saves DCP as {"model": sd}).
OUTER_PREFIXES = ("", "model.", "state_dict.", "module.")
PEFT_PREFIX = "base_model.model."
LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector")
DTYPES = ("auto", "bf16", "fp16", "fp32")


def strip_wrappers(name: str) -> str:
    """Remove wrapper segments (``module.``, ``_fsdp_wrapped_module.``...) wherever they occur."""
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
        name = name.replace("." + prefix, ".")
    return name


def choose_outer_prefix(names: Iterable[str], expected: set[str] | None) -> str:
    """The outer prefix whose removal makes the most names match ``expected`` ("" when none helps)."""
    names = [strip_wrappers(n) for n in names]
    if not expected:
        return ""
    best, best_hits = "", -1
    for prefix in OUTER_PREFIXES:
        hits = sum(1 for n in names if n.startswith(prefix) and n[len(prefix) :] in expected)
        if hits > best_hits:
            best, best_hits = prefix, hits
    return best


def rename(name: str, outer_prefix: str) -> str:
    name = strip_wrappers(name)
    return name[len(outer_prefix) :] if outer_prefix and name.startswith(outer_prefix) else name


def is_lora_name(name: str) -> bool:
    return any(marker in name for marker in LORA_MARKERS)


def peft_relative(name: str) -> str:
    """Drop any container prefix before PEFT's root: accelerate's DCP saves ``model.base_model.model...``."""
    start = name.find(PEFT_PREFIX)
    return name[start:] if start > 0 and name[start - 1] == "." else name


def adapter_key(name: str, adapter_name: str = "default") -> str:
    """PEFT's saved form: ``...q_proj.lora_A.default.weight`` -> ``base_model.model...q_proj.lora_A.weight``."""
    return peft_relative(name).replace(f".{adapter_name}.", ".").replace(f".{adapter_name}", "")


def base_key(name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``."""
    name = peft_relative(name)
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True)
class LoraMerge:
    """How to merge LoRA factors into a base weight: ``W + scaling * B @ A`` (PEFT ``Linear.get_delta_weight``)."""

    scaling: float
    fan_in_fan_out: bool = False

    @classmethod
    def from_adapter_config(cls, config: dict) -> LoraMerge:
        unsupported = [key for key in ("rank_pattern", "alpha_pattern") if config.get(key)] + (
            ["use_dora"] if config.get("use_dora") else []
        )
        if config.get("peft_type", "LORA") != "LORA" or unsupported:
            raise ValueError(
                f"--merge-adapter supports plain LoRA adapters; this one has peft_type={config.get('peft_type')!r} "
                f"and options {unsupported}. Write the adapter with --adapter and merge it with PEFT's merge_and_unload()"
            )
        r, alpha = int(config["r"]), float(config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        return cls(scaling=scaling, fan_in_fan_out=bool(config.get("fan_in_fan_out")))

    def merge(self, weight: Any, lora_a: Any, lora_b: Any) -> Any:
        delta = (lora_b.float() @ lora_a.float()) * self.scaling
        if self.fan_in_fan_out:
            delta = delta.T
        return (weight.float() + delta).to(weight.dtype)


def output_dtype(requested: str, train_dtype: str | None, stored: Any) -> Any:
    """The torch dtype to write: ``auto`` means the run's training dtype, else the stored one."""
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if requested not in DTYPES:
        raise ValueError(f"dtype {requested!r} is not supported; use one of {DTYPES}")
    if requested != "auto":
        return table[requested]
    if train_dtype in table:
        return table[train_dtype]
    return stored


def cast(tensor: Any, dtype: Any) -> Any:
    """Cast floating tensors only; integer buffers keep their dtype."""
    if tensor.is_floating_point() and tensor.dtype != dtype:
        return tensor.to(dtype)
    return tensor
