"""Bytes per element of what each engine keeps under a precision: the dtype layout every memory term reads.

:class:`Dtypes` names, in bytes per element, the weights, master copy, gradients, optimizer moments, compute and
residual stream a strategy keeps; :func:`engine_dtypes` derives it from the strategy and the precision (the sources
for each engine are in its docstring). ``GIB`` and ``FP32`` are the units the memory model counts in.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist.planning.layout import Strategy, strategy

GIB = 1024**3
FP32 = 4


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what a strategy keeps under a precision (see :func:`engine_dtypes`).

    ``weights``: the trainable weights as the engine stores them; ``master``: a separate fp32 copy
    (DeepSpeed); ``grads``: the gradient dtype kept until the step; ``state``: one optimizer moment;
    ``compute``: activations; ``residual``: the residual stream (fp32 when autocast runs an fp32 model);
    ``autocast``: every linear casts its input and weight to ``compute``.
    """

    weights: int
    master: int
    grads: int
    state: int
    compute: int
    residual: int
    autocast: bool


def engine_dtypes(
    s: Strategy | str, param_bytes: int, master_weights: bool, method: str = "full", base_bytes: int = 2
) -> Dtypes:
    """What each engine keeps for a precision.

    ``param_bytes`` is the compute dtype (2: bf16/fp16, 4: fp32); ``master_weights`` asks for fp32
    master weights and optimizer state (mixed precision); ``param_bytes=2, master_weights=False`` is
    pure bf16.

    - DDP / one process, mixed: the weights are fp32 (``hf_dist.auto_args`` upcasts a 16-bit-loaded
      model) and ``torch.autocast`` computes in bf16: each linear saves a bf16 copy of its input, the
      embedding output and so the residual stream stay fp32, gradients are fp32.
    - FSDP2, mixed: accelerate upcasts the sharded parameters to fp32
      (``accelerate/utils/fsdp_utils.py`` fsdp2_prepare_model); ``MixedPrecisionPolicy(param_dtype=bf16)``
      gathers bf16 units, so compute and the residual stream are bf16; sharded gradients are fp32
      (reduce_dtype fp32, ``hf_dist.configs.fsdp.apply_fp32_reduce``).
    - DeepSpeed, mixed: bf16 module weights, an fp32 master partition, and fp32 gradient partitions
      (hf_dist's JSON sets ``data_types.grad_accum_dtype = fp32``).
    - LoRA / QLoRA: the frozen base stays in the dtype it was loaded in (``base_bytes``): 16-bit makes
      compute and the residual stream 16-bit; an fp32 base runs under autocast like DDP. The adapters
      follow the rules above.
    """
    s = strategy(s)
    if param_bytes == FP32:  # fp32 training: no autocast; ZeRO-1/2 still keep a separate fp32 partition
        master = FP32 if master_weights and s.is_deepspeed and not s.shards.params else 0
        return Dtypes(FP32, master, FP32, FP32, FP32, FP32, False)
    if not master_weights:  # pure 16-bit: weights, gradients and optimizer moments all 16-bit
        return Dtypes(param_bytes, 0, param_bytes, param_bytes, param_bytes, param_bytes, False)
    if s.is_deepspeed:
        return Dtypes(param_bytes, FP32, FP32, FP32, param_bytes, param_bytes, False)
    frozen_base_16bit = method != "full" and base_bytes < FP32
    if s.is_fsdp or frozen_base_16bit:
        return Dtypes(FP32, 0, FP32, FP32, param_bytes, param_bytes, False)
    return Dtypes(FP32, 0, FP32, FP32, param_bytes, FP32, True)
