"""Liger kernels traced: liger-kernel 0.8.5's autograd functions as fakes that allocate and save what its Triton
forwards and backwards do, applied to the model the way the Trainer applies Liger.

Triton does not run on CPU, and liger-kernel is rarely installed where the trace runs, so hf_dist carries its own
copy of what Liger 0.8.5 does (:mod:`.functions`, :mod:`.patch`), derived from its source. Where another release is
installed, tracing Liger is refused with both versions named (:func:`.version.version_refusal`): its kernels may
keep other tensors, and a trace of 0.8.5 would be a wrong answer for it. docs/measurements.md, "The tracer against GPU
allocation", has the figures against an H200.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from hf_dist.tracing.liger.version import LIGER_MODEL_TYPES, LIGER_VERSION, model_refusal, version_refusal

__all__ = ["LIGER_MODEL_TYPES", "LIGER_VERSION", "liger_applied", "model_refusal", "version_refusal"]


@contextlib.contextmanager
def liger_applied(enabled: bool, config: Any) -> Iterator[Callable[[Any], Any]]:
    """While open, the modeling module's RoPE is Liger's (fake); yields the function that patches a model instance
    (the identity when ``enabled`` is False). Check :func:`model_refusal` first."""
    if not enabled:
        yield lambda model: model
        return
    from hf_dist.tracing.liger.patch import liger_rope, patch_model

    with liger_rope(config.model_type):
        yield patch_model
