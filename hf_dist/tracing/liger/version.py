"""Which Liger the fakes copy, and when a trace must refuse Liger (no torch import: ``TraceSetup`` asks first)."""

from __future__ import annotations

import importlib.metadata
from typing import Any

# the liger-kernel release whose source hf_dist/tracing/liger/ copies, allocation for allocation
LIGER_VERSION = "0.8.5"
# model types whose apply_liger_kernel_to_<type> (liger_kernel/transformers/monkey_patch.py) is copied here: RoPE,
# RMSNorm (llama casting, in place), SwiGLU and the fused linear cross-entropy forward, each Liger's default
LIGER_MODEL_TYPES = ("llama", "mistral", "qwen2")


def installed_liger_version() -> str | None:
    """The installed liger-kernel's version, or None where it is not installed (CPU machines: it needs Triton)."""
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_refusal() -> str | None:
    """Why Liger cannot be traced with this liger-kernel installed, or None: the fakes copy :data:`LIGER_VERSION`;
    another release may allocate or save other tensors, so its run is never traced as if it were 0.8.5. Where
    liger-kernel is not installed the trace uses hf_dist's copy, i.e. assumes the run has 0.8.5."""
    installed = installed_liger_version()
    if installed is None or installed == LIGER_VERSION:
        return None
    return (
        f"Liger kernels: liger-kernel {installed} is installed, but hf_dist's fake Liger functions copy "
        f"{LIGER_VERSION}; install liger-kernel=={LIGER_VERSION} to trace"
    )


def model_refusal(config: Any) -> str | None:
    """Why Liger cannot be traced on this model, or None (a model type whose Liger patch is not copied here)."""
    model_type = getattr(config, "model_type", None)
    if model_type in LIGER_MODEL_TYPES:
        return None
    return (
        f"Liger kernels on model_type {model_type!r}: hf_dist copies Liger {LIGER_VERSION}'s patches for "
        f"{', '.join(LIGER_MODEL_TYPES)} only"
    )
