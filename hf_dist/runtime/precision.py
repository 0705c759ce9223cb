"""Fp32 master weights on a live model, unless pure bf16 is asked for (the dtype policy itself: :mod:`hf_dist.planning.precision`).

Most users load with ``from_pretrained(..., dtype=torch.bfloat16)``. What each strategy then does
with ``bf16=True`` (transformers 5.x, accelerate 1.x, DeepSpeed 0.19):

* DDP / one process: nothing. The optimizer steps the bf16 parameters, so weights and Adam state
  stay bf16 (no fp32 master copy). :func:`prepare_model` upcasts the trainable parameters to fp32
  so bf16 autocast runs on fp32 masters, as the plan assumes.
* FSDP2: accelerate's ``fsdp2_prepare_model`` upcasts trainable parameters to fp32 whenever
  ``mixed_precision != "no"``; ``MixedPrecisionPolicy(param_dtype=bf16)`` casts them for compute.
* DeepSpeed ZeRO-1/2/3: the engine casts the module to bf16 and keeps an fp32 partition of the
  master weights with fp32 Adam state, unless ``bf16.bf16_master_weights_and_grads`` and
  ``bf16.bf16_optimizer_states`` are set.

Pure bf16 (``pure_bf16=True``: bf16 weights and bf16 Adam state, no fp32 master copy) halves the
Adam state and drops the master copy, at a known cost in accuracy: updates smaller than bf16's resolution (8 bits of
mantissa, ~0.4% of the weight) are lost. It is only done when asked for.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hf_dist.planning.layout import strategy
from hf_dist.planning.precision import dtype_name, float_params, is_module

logger = logging.getLogger(__name__)


def prepare_model(model: Any, plan: Any, mixed_precision: str | None = None) -> None:
    """Make ``model`` (in place) train with the precision ``plan`` states; a no-op for names/configs/counts.

    ``mixed_precision``: what the final ``TrainingArguments`` flags enable (default: the plan's).

    * pure bf16: every trainable floating-point parameter must already be bf16 (else ValueError).
    * bf16/fp16 mixed precision under DDP / one process: trainable bf16/fp16 parameters are upcast to
      fp32 (frozen ones, e.g. a LoRA base, stay as loaded: autocast computes in 16 bit anyway).
      FSDP2 and DeepSpeed keep fp32 masters themselves (module docstring).
    * no mixed precision (fp32 training, e.g. CPU): every floating-point parameter is upcast, for
      every strategy, since no autocast bridges bf16 and fp32 tensors.
    Quantized parameters are never touched. One warning says what was upcast.
    """
    if not is_module(model):
        return
    import torch

    if plan.pure_bf16:
        wrong = sorted({dtype_name(p.dtype) for _, p in float_params(model) if p.requires_grad} - {"bfloat16"})
        if wrong:
            raise ValueError(
                f"pure_bf16=True trains bf16 weights, but the model has trainable {'/'.join(wrong)} parameters; "
                "load it with dtype=torch.bfloat16 (or call model.to(torch.bfloat16)), or drop pure_bf16."
            )
        return
    mixed_precision = mixed_precision or plan.mixed_precision
    everything = mixed_precision == "no"
    if not everything and not strategy(plan.strategy).is_ddp:
        return
    upcast = [
        p
        for _, p in float_params(model)
        if p.dtype in (torch.bfloat16, torch.float16) and (everything or p.requires_grad)
    ]
    if not upcast:
        return
    dtypes = "/".join(sorted({dtype_name(p.dtype) for p in upcast}))
    with torch.no_grad():
        for param in upcast:
            param.data = param.data.to(torch.float32)
    if int(os.environ.get("RANK", "0")) == 0:
        which = "floating-point" if everything else "trainable"
        why = "fp32 training (no mixed precision)" if everything else f"{mixed_precision} mixed precision"
        logger.warning(
            "hf_dist: upcast %d %s %s parameter tensors (%d params) of the model to float32 in place, for %s with "
            "fp32 master weights and Adam state under %s. For bf16 weights and Adam state (half the optimizer "
            "memory, less accurate updates) pass pure_bf16=True.",
            len(upcast),
            which,
            dtypes,
            sum(p.numel() for p in upcast),
            why,
            plan.strategy,
        )
