"""The model states per rank: weights, gradients and optimizer state, on the device, in host RAM or in swap files.

Rajbhandari et al., "ZeRO" (2020) sec. 3.1 for the sharding; the dtypes are the ones each engine really keeps
(:func:`hf_dist.planning.dtypes.engine_dtypes`). Units: every function returns bytes (``_bytes`` in its name) for
ONE rank.
"""

from __future__ import annotations

import math

from hf_dist.planning.dtypes import FP32, Dtypes
from hf_dist.planning.layout import Strategy
from hf_dist.planning.lora import LoraSpec
from hf_dist.planning.lora_plan import Placement, place
from hf_dist.planning.nvme import host_bytes, param_buffer_elements, param_swapper_bytes, per_rank, swap_files

# QLoRA (Dettmers et al. 2023, sec. 3): NF4 = 4 bits/param; double quantisation stores one 8-bit absmax
# per 64 params plus one fp32 constant per 256 blocks = 8/64 + 32/(64*256) = 0.127 bits/param.
QLORA_BASE_BYTES_PER_PARAM = 0.5 + (8 / 64 + 32 / (64 * 256)) / 8


def lora_trainable_params(spec, rank: int) -> int:
    """The recipes' LoRA at ``rank``: rank * (in + out) for each linear (q,k,v,o,gate,up,down) of every decoder
    layer that the model has (Hu et al. 2021; a mixture of experts has no gate/up/down linears)."""
    return place(spec, LoraSpec(rank=rank)).trainable


def trainable_params(spec, method: str, lora: Placement | None) -> int:
    """Every parameter under full fine-tuning; LoRA's adapters, saved module copies and trainable biases else."""
    if method == "full":
        return spec.num_params
    return (lora or place(spec, LoraSpec())).trainable


def base_weight_bytes(spec, method: str, param_bytes: int) -> float:
    """Bytes of the frozen base weights (LoRA: 16-bit as loaded; QLoRA: NF4 linears, 16-bit embeddings)."""
    if method != "qlora":
        return spec.num_params * param_bytes
    # bitsandbytes quantises the Linear layers; embeddings and lm_head stay in 16-bit
    unquantised = spec.embedding_params + spec.lm_head_params
    return (spec.num_params - unquantised) * QLORA_BASE_BYTES_PER_PARAM + unquantised * param_bytes


def optimizer_state_bytes(optimizer: str, state: int) -> int:
    """Bytes per trainable param of optimizer state: AdamW keeps two moments in the dtype of the
    weights it steps (torch ``zeros_like``); bitsandbytes' 8-bit Adam 1 byte each; SGD one momentum."""
    return {"adamw": 2 * state, "adamw_8bit": 2, "sgd": state}[optimizer]


def bf16_optimizer(s: Strategy, lay: Dtypes) -> bool:
    """ZeRO-1 with 16-bit compute and fp32 masters runs DeepSpeed's ``BF16_Optimizer`` (engine.py)."""
    return s.zero_stage == 1 and bool(lay.master) and lay.compute < FP32


def shard_bytes(full: float, sharded: bool, degree: int) -> int:
    return math.ceil(full / degree) if sharded else math.ceil(full)


def param_bytes_per_rank(spec, s: Strategy, degree, method, offload, lay: Dtypes, base_bytes, lora) -> int:
    """The weights each rank keeps between steps (gathered units and working copies are buffers).

    Shard-grad-op keeps its fp32 shards plus the bf16 units gathered for the whole step (buffers). LoRA: the frozen
    base as loaded, the parameters PEFT adds (adapters, ``modules_to_save`` copies) in the trainable dtype, and base
    biases that train upcast to it (``auto_args`` upcasts every trainable parameter)."""
    if offload == "optimizer+params":
        return 0
    if method == "full":
        full = spec.num_params * lay.weights
    else:
        upcast = lora.trainable_biases * max(lay.weights - base_bytes, 0)
        full = base_weight_bytes(spec, method, base_bytes) + lora.new_params * lay.weights + upcast
    sharded = s.shards.params  # shard-grad-op: its shards at rest; the gathered units are buffers
    return shard_bytes(full, sharded, degree)


def grad_bytes_per_rank(
    s: Strategy, degree, trainable, offload, lay: Dtypes, accumulation=1, sync_each_batch=False
) -> int:
    """Gradients kept until the optimizer step.

    - DDP / FSDP2: ``param.grad`` in the weights' dtype (FSDP2: views into fp32 reduce-scatter outputs).
    - ZeRO-1 with 16-bit compute and fp32 accumulation (hf_dist's JSON) runs DeepSpeed's
      ``BF16_Optimizer`` (engine.py ``_do_optimizer_sanity_check``): a full, unpartitioned fp32 gradient
      buffer from init (bf16_optimizer.py ``_setup_for_real_optimizer``). Its bf16 autograd gradients live from
      backward to the step, when the engine's ``zero_grad`` frees them: a step transient
      (:func:`hf_dist.planning.transients.step_bytes_per_rank`); found by tracing DeepSpeed 0.19.8.
    - ZeRO-1 in fp32 (stage_1_and_2.py) reduces into gradient partitions at the end of backward, so with
      one micro-batch per step only the partition survives; with accumulation it keeps full gradients.
    - ZeRO-2: the fp32 partition (stage_1_and_2.py ``_build_compact_grad_partition_buffer``), freed
      after the step. ZeRO-3: ``grad_partitions_flat_buffer``, an fp32 partition kept from init (stage3.py).
    - FSDP2 with gradient accumulation: the Trainer runs every micro-batch but the last under accelerate's
      ``no_sync``, which for FSDP2 is ``set_requires_gradient_sync(False)``: no reduce-scatter, and each parameter
      keeps its *unsharded* gradient, upcast to the reduce dtype (torch ``_fsdp_param.py``
      ``to_accumulated_grad_if_needed``), until the last micro-batch. Found by tracing 8B on 64 ranks. With
      ``sync_each_batch`` (accelerate's ``GradientAccumulationPlugin``; the Trainer then runs no ``no_sync``) every
      micro-batch reduce-scatters, and only the sharded gradients, accumulated in place, persist between them
      (torch ``_fsdp_collectives.foreach_reduce``): the full-shard size.
    """
    if s.is_fsdp and accumulation > 1 and not sync_each_batch:
        return trainable * lay.grads
    if bf16_optimizer(s, lay):
        return trainable * FP32
    sharded = s.shards.grads or (s.zero_stage == 1 and accumulation == 1)
    # ZeRO-Offload keeps gradient partitions in pinned host memory (stage 2/3); FSDP2 offload too
    if offload != "none" and sharded:
        return 0
    return shard_bytes(trainable * lay.grads, sharded, degree)


def grads_persist(s: Strategy, lay: Dtypes, accumulation: int) -> bool:
    """Whether gradients are alive during forward (not only from backward to the step)."""
    return accumulation > 1 or s.zero_stage == 3 or bf16_optimizer(s, lay)


def optimizer_bytes_per_rank(s: Strategy, degree, trainable, offload, optimizer, lay: Dtypes) -> int:
    """Optimizer moments plus DeepSpeed's separate fp32 master partition."""
    if offload != "none":
        return 0
    full = trainable * (optimizer_state_bytes(optimizer, lay.state) + lay.master)
    return shard_bytes(full, s.shards.optimizer, degree)


def cpu_bytes_per_rank(
    spec, degree, trainable, method, offload, optimizer, lay: Dtypes, compute, nvme=False, device="cuda"
) -> int:
    """Host memory per rank holding offloaded states (fp32 gradients on the host for ZeRO-Offload); with NVMe,
    what DeepSpeed still pins on the host (:func:`hf_dist.planning.nvme.host_bytes`)."""
    if offload == "none":
        return 0
    if nvme:
        weights = per_rank(base_weight_bytes(spec, method, 1), degree)
        params = offload == "optimizer+params"
        swapper, size = param_swapper_bytes(device, compute), nvme_param_buffer(spec, degree)
        return host_bytes(per_rank(trainable, degree), weights, compute, params, swapper, size)
    states = trainable * (optimizer_state_bytes(optimizer, FP32) + FP32 + FP32)  # moments, master, fp32 grads
    if offload == "optimizer+params":
        states += base_weight_bytes(spec, method, compute)
    return math.ceil(states / degree)


def swap_bytes_per_rank(spec, degree, trainable, method, offload, optimizer, lay: Dtypes, compute, device) -> int:
    """ZeRO-Infinity's swap files per rank (:func:`hf_dist.planning.nvme.swap_files`): the master partition (fp32, or
    bf16 under pure bf16) with the optimizer's moments and gradients in the same dtype, and the parameter partitions
    in the parameter swapper's dtype (:func:`~hf_dist.planning.nvme.param_swapper_bytes`)."""
    tensors = (
        [per_rank(n, degree) for n in trainable_tensors(spec)] if method == "full" and spec.lora_linears else None
    )
    state = optimizer_state_bytes(optimizer, lay.state)
    params = offload == "optimizer+params"
    swapper = param_swapper_bytes(device, compute)
    return swap_files(per_rank(trainable, degree), state, lay.state, swapper, params, tensors).total


def nvme_param_buffer(spec, degree: int) -> int:
    """``offload_param.buffer_size`` for ``spec`` sharded over ``degree`` ranks (:func:`~hf_dist.planning.nvme.
    param_buffer_elements`): the largest weight tensor's partition, or the default for a bare count."""
    tensors = trainable_tensors(spec) if spec.has_shape else []
    return param_buffer_elements(max((per_rank(n, degree) for n in tensors), default=0))


def trainable_tensors(spec) -> list[int]:
    """Elements of each weight tensor of a full fine-tuning: the embedding, an untied head, each decoder layer's
    linears (``ModelSpec.lora_linears``) and, in an MoE layer, the rest of the layer as one stacked expert tensor;
    the norms are left out (they are far under DeepSpeed's 1 MiB swap threshold)."""
    linears = [i * o for _, i, o in spec.lora_linears]
    layer = linears + ([spec.layer_params - sum(linears)] if spec.experts else [])
    head = [spec.lm_head_params] if not spec.tie_word_embeddings and spec.lm_head_params else []
    return [spec.embedding_params, *head, *layer * spec.num_layers]
