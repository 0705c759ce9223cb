"""Per-rank training memory by component: pure arithmetic, no I/O, no GPU.

The model follows what the libraries allocate, tensor by tensor, and names its source at each term:

- **Model states** (params, grads, optimizer): Rajbhandari et al., "ZeRO" (2020) sec. 3.1 for the
  sharding; the dtypes are the ones each engine really keeps (:func:`engine_dtypes`): the Trainer's autocast
  keeps fp32 weights and bf16 working copies, FSDP2's ``MixedPrecisionPolicy`` fp32 shards and bf16
  gathered units, DeepSpeed bf16 weights next to an fp32 master partition.
- **Activations**: every tensor the HF Llama block saves for backward, counted per token
  (:func:`layer_activation_bytes`; Korthikanti et al. 2022 eq. 1 is the GPT analogue), with Liger
  kernels' fused RMSNorm / SwiGLU / RoPE where they are used.
- **Logits**: the LM head and the loss (``transformers.loss.loss_utils.ForCausalLMLoss`` upcasts the
  ``[tokens, vocab]`` logits to fp32; its backward holds three fp32 copies), or Liger's fused linear
  cross-entropy, which never materialises them (:func:`logits_bytes`).
- **Buffers**: autocast weight copies, gathered FSDP2 / ZeRO-3 units, DDP and DeepSpeed buckets.
- **Step**: transients of the optimizer step (torch AdamW's foreach ``sqrt`` list; DeepSpeed's fp32
  gradient partition), which coexist with gradients, not with activations.
- **Allocator**: what torch's caching allocator reserves beyond the peak allocated (:func:`allocator_bytes`).
- **Overhead**: the CUDA context, library workspaces and NCCL communicators, outside torch's allocator.

``MemoryEstimate.total`` predicts the device memory in use at the peak (``total - free`` from
``cudaMemGetInfo``), ``allocated`` predicts ``torch.cuda.max_memory_allocated`` and ``reserved``
``max_memory_reserved``. Checked against an H100 in ``benchmarks/gpu_ground_truth.py`` and against
tensors allocated on CPU ranks in ``benchmarks/planner_accuracy.py`` (docs/planner.md).

Units: every function returns bytes (``_bytes`` in its name) for ONE rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from hf_dist.planning.activations import (
    FP32,
    Lora,
    activation_bytes,
    largest_transient_bytes,
    layer_gradient_bytes,
    logits_bytes,
    trl_head_bytes,
)
from hf_dist.planning.layout import Layout, Strategy, strategy
from hf_dist.planning.nvme import host_bytes, param_buffer_elements, param_swapper_bytes, per_rank, swap_files
from hf_dist.validation import check_choice, check_positive_int

METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
ATTENTIONS = ("sdpa", "flash_attention_2", "eager")
DEVICES = ("cuda", "cpu")

GIB = 1024**3

# deepspeed/runtime/zero/config.py defaults, which hf_dist's DeepSpeed JSON writes out explicitly
# (hf_dist/configs/deepspeed.py) so that plan and config agree: reduce_bucket_size 5e8 elements,
# stage3_prefetch_bucket_size 5e7. The reduce buckets are allocated at their full size whatever the
# model size (measured on CPU ranks: +2.0 GB for a 7M-parameter fp32 model, benchmarks/planner_accuracy.py).
DS_REDUCE_BUCKET_ELEMENTS = int(5e8)
DS_PREFETCH_BUCKET_ELEMENTS = int(5e7)
DS_SUB_GROUP_ELEMENTS = int(1e9)
# Outside torch's allocator, measured as device_used - max_memory_reserved on an H100 (torch 2.11,
# CUDA 13; ../shared/gpu): 1.30 GiB in every single-process case (CUDA context, cuBLAS/cuBLASLt
# workspaces, loaded kernel images), 0.38 GiB more once NCCL communicators exist (the DeepSpeed cases,
# which create them even on one GPU). Other GPUs and CUDA versions land within a few hundred MiB.
CUDA_CONTEXT_BYTES = int(1.30 * GIB)
NCCL_BYTES = int(0.38 * GIB)
# QLoRA (Dettmers et al. 2023, sec. 3): NF4 = 4 bits/param; double quantisation stores one 8-bit absmax
# per 64 params plus one fp32 constant per 256 blocks = 8/64 + 32/(64*256) = 0.127 bits/param.
QLORA_BASE_BYTES_PER_PARAM = 0.5 + (8 / 64 + 32 / (64 * 256)) / 8
LORA_DROPOUT = 0.05  # the recipes' --lora_dropout (hf_dist.recipe_utils.LoraArguments)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by component.

    ``total`` is the predicted device memory in use at the peak, ``allocated`` the peak of live
    tensors (``torch.cuda.max_memory_allocated``), ``reserved`` what the caching allocator holds
    (``max_memory_reserved``). ``cpu`` is host memory per rank used by offloaded states.

    The peak is the largest of three moments: the start of backward, when every saved activation and the loss's
    logits are alive; a decoder layer's backward, when its gathered units (``unit_buffers``: FSDP2 / ZeRO-3) and,
    under activation checkpointing, its recomputed activations (``recompute``) are, with the gradients its backward
    has in flight (``layer_grads``), but no longer the logits; and
    the optimizer step, when the gradients and the step's transients are (``grads_overlap_activations``). With
    one micro-batch per step the Trainer frees gradients after each step (``zero_grad(set_to_none=True)``), so
    gradients and activations never coexist in full: their largest overlap is the backward of the first decoder
    layer, the last one run, when every other gradient exists next to that layer's activations (``last_layer``:
    recomputed under checkpointing, else saved) and gathered units; with gradient accumulation the gradients
    persist through the next forward. ``activations`` includes ``recompute`` and ``buffers`` includes
    ``unit_buffers``.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int
    cpu: int = 0
    grads_overlap_activations: bool = False
    logits: int = 0
    step: int = 0
    allocator: int = 0
    recompute: int = 0
    unit_buffers: int = 0
    last_layer: int = 0
    layer_grads: int = 0
    swap: int = 0  # ZeRO-Infinity's swap files under nvme_path (offload_device="nvme"), not memory

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def allocated(self) -> int:
        layer_moment = self.recompute + self.unit_buffers + self.layer_grads
        forward_backward = self.activations - self.recompute + max(self.logits, layer_moment)
        if self.grads_overlap_activations:
            # the first decoder layer's backward, the last one run: every other gradient exists, and only that
            # layer's activations, gathered units and gradients in flight are still alive
            end_of_backward = self.grads + self.last_layer + self.unit_buffers + self.layer_grads
            transient = max(forward_backward, end_of_backward, self.grads + self.step)
        else:
            transient = max(forward_backward + self.grads, self.grads + self.step)
        return self.params + self.optimizer + self.buffers - self.unit_buffers + transient

    @property
    def reserved(self) -> int:
        return self.allocated + self.allocator

    @property
    def total(self) -> int:
        return self.reserved + self.overhead

    def to_dict(self) -> dict[str, int]:
        keys = ("params", "grads", "optimizer", "activations", "logits", "buffers", "step", "allocator", "overhead")
        keys += ("cpu", "swap", "model_states", "allocated", "reserved", "total")
        return {k: int(getattr(self, k)) for k in keys}

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.to_dict().items()}


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


# ---------------------------------------------------------------- validation


def validate_args(layout: Layout, method, optimizer, param_bytes, grad_bytes, lora_rank) -> None:
    """Raise ValueError naming the bad argument, the allowed values and the fix (the layout checked itself)."""
    check_choice("method", method, METHODS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    check_positive_int("lora_rank", lora_rank)
    if method == "qlora" and layout.offload != "none":
        raise ValueError(f"qlora keeps 4-bit base weights on the GPU; offload must be 'none', got {layout.offload!r}")
    if param_bytes not in (2, 4):
        raise ValueError(
            f"param_bytes must be 2 (bf16/fp16 compute) or 4 (fp32), got {param_bytes!r}; "
            "the memory model knows float32, bfloat16 and float16"
        )
    if grad_bytes not in (None, 2, 4):
        raise ValueError(f"grad_bytes must be 2, 4 or None (what the strategy keeps), got {grad_bytes!r}")


# ---------------------------------------------------------------- parameters


def lora_trainable_params(spec, rank: int) -> int:
    """LoRA params: rank * (in + out) for each adapted linear (q,k,v,o,gate,up,down) of every decoder layer
    (Hu et al. 2021): the model's own linears when known (a mixture of experts has no gate/up/down linears)."""
    if not spec.has_shape:
        raise ValueError("LoRA/QLoRA estimates need the model's shape; pass a config, folder or model, not a count")
    if spec.lora_linears:
        return rank * sum(i + o for _, i, o in spec.lora_linears) * spec.num_layers
    h, inter = spec.hidden_size, spec.intermediate_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    per_layer = rank * ((h + q_out) + 2 * (h + kv_out) + (q_out + h) + 2 * (h + inter) + (inter + h))
    return per_layer * spec.num_layers


def trainable_params(spec, method: str, lora_rank: int) -> int:
    return spec.num_params if method == "full" else lora_trainable_params(spec, lora_rank)


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


def _bf16_optimizer(s: Strategy, lay: Dtypes) -> bool:
    """ZeRO-1 with 16-bit compute and fp32 masters runs DeepSpeed's ``BF16_Optimizer`` (engine.py)."""
    return s.zero_stage == 1 and bool(lay.master) and lay.compute < FP32


def _split(full: float, sharded: bool, degree: int) -> int:
    return math.ceil(full / degree) if sharded else math.ceil(full)


def param_bytes_per_rank(spec, s: Strategy, degree, method, offload, lay: Dtypes, base_bytes, lora_rank) -> int:
    """The weights each rank keeps between steps (gathered units and working copies are buffers).

    Shard-grad-op keeps its fp32 shards plus the bf16 units gathered for the whole step (buffers)."""
    if offload == "optimizer+params":
        return 0
    if method == "full":
        full = spec.num_params * lay.weights
    else:
        full = base_weight_bytes(spec, method, base_bytes) + trainable_params(spec, method, lora_rank) * lay.weights
    sharded = s.shards.params  # shard-grad-op: its shards at rest; the gathered units are buffers
    return _split(full, sharded, degree)


def grad_bytes_per_rank(s: Strategy, degree, trainable, offload, lay: Dtypes, accumulation=1) -> int:
    """Gradients kept until the optimizer step.

    - DDP / FSDP2: ``param.grad`` in the weights' dtype (FSDP2: views into fp32 reduce-scatter outputs).
    - ZeRO-1 with 16-bit compute and fp32 accumulation (hf_dist's JSON) runs DeepSpeed's
      ``BF16_Optimizer`` (engine.py ``_do_optimizer_sanity_check``): a full, unpartitioned fp32 gradient
      buffer from init plus the bf16 autograd gradients, which it zeroes but never frees
      (bf16_optimizer.py ``_setup_for_real_optimizer``, ``clear_lp_grads``).
    - ZeRO-1 in fp32 (stage_1_and_2.py) reduces into gradient partitions at the end of backward, so with
      one micro-batch per step only the partition survives; with accumulation it keeps full gradients.
    - ZeRO-2: the fp32 partition (stage_1_and_2.py ``_build_compact_grad_partition_buffer``), freed
      after the step. ZeRO-3: ``grad_partitions_flat_buffer``, an fp32 partition kept from init (stage3.py).
    - FSDP2 with gradient accumulation: the Trainer runs every micro-batch but the last under accelerate's
      ``no_sync``, which for FSDP2 is ``set_requires_gradient_sync(False)``: no reduce-scatter, and each parameter
      keeps its *unsharded* gradient, upcast to the reduce dtype (torch ``_fsdp_param.py``
      ``to_accumulated_grad_if_needed``), until the last micro-batch. Found by tracing 8B on 64 ranks.
    """
    if s.is_fsdp and accumulation > 1:
        return trainable * lay.grads
    if _bf16_optimizer(s, lay):
        return trainable * (FP32 + lay.compute)
    sharded = s.shards.grads or (s.zero_stage == 1 and accumulation == 1)
    # ZeRO-Offload keeps gradient partitions in pinned host memory (stage 2/3); FSDP2 offload too
    if offload != "none" and sharded:
        return 0
    return _split(trainable * lay.grads, sharded, degree)


def grads_persist(s: Strategy, lay: Dtypes, accumulation: int) -> bool:
    """Whether gradients are alive during forward (not only from backward to the step)."""
    return accumulation > 1 or s.zero_stage == 3 or _bf16_optimizer(s, lay)


def optimizer_bytes_per_rank(s: Strategy, degree, trainable, offload, optimizer, lay: Dtypes) -> int:
    """Optimizer moments plus DeepSpeed's separate fp32 master partition."""
    if offload != "none":
        return 0
    full = trainable * (optimizer_state_bytes(optimizer, lay.state) + lay.master)
    return _split(full, s.shards.optimizer, degree)


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
    in the parameter swapper's dtype (bf16 on CPU ranks, see :func:`~hf_dist.planning.nvme.host_bytes`)."""
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


def step_bytes_per_rank(spec, s: Strategy, degree, trainable, offload, lay: Dtypes) -> int:
    """Transients of the end of backward and the optimizer step, which coexist with the gradients.

    The Trainer's default optimizer on CUDA is ``adamw_torch_fused``: no state-sized temporaries.
    DeepSpeed (bf16, fp32 accumulation):
    - ZeRO-1 (``BF16_Optimizer``): the bf16 cast of the gradients all-reduced at the accumulation
      boundary (engine.py ``allreduce_bucket``) and one fp32 upcast of the largest parameter;
    - ZeRO-1/2 in stage_1_and_2.py: the contiguous-gradient buckets (reduce_bucket_size elements, two
      with overlap_comm), allocated at the first gradient hook of each backward and freed at its end;
      fp64 norm temporaries of the largest parameter's partition (``get_grad_norm_direct``);
    - ZeRO-3: the flattened fp32 gradient of one sub-group (sub_group_size 1e9 elements) in ``step``
      and the same fp64 norm temporaries.
    """
    if not s.is_deepspeed or offload != "none":
        return 0
    largest = min(max(spec.layer_params, spec.embedding_params), trainable) if spec.has_shape else 0
    norm = _split(largest * 8, True, degree)
    if _bf16_optimizer(s, lay):
        return trainable * lay.compute + largest * FP32
    if s.zero_stage in (1, 2):
        buckets = 2 if s.zero_stage == 2 and lay.compute < FP32 else 1  # overlap_comm (hf_dist: stage >= 2)
        return buckets * DS_REDUCE_BUCKET_ELEMENTS * lay.compute + norm
    return min(DS_SUB_GROUP_ELEMENTS, _split(trainable, True, degree)) * FP32 + norm


# ---------------------------------------------------------------- buffers


def _linear_params(spec) -> int:
    """Weights that pass through a linear layer: everything but the input embedding (unless tied to lm_head)."""
    return spec.num_params - (spec.embedding_params if spec.lm_head_params else 0)


def buffer_bytes(
    spec, s: Strategy, world_size, trainable, lay: Dtypes, ckpt: bool, padded: int = 0, *, embedding_unit: bool = True
) -> tuple[int, int]:
    """(working copies and communication buffers alive during forward, per rank; the part of them gathered only
    around one decoder layer, which is free while the loss's logits are alive: the tracer's peaks at the loss show
    no decoder unit gathered).

    - autocast (DDP mixed): the bf16 copy of every linear weight, cached by autocast and saved by the
      linear for backward (torch ``cached_cast``); with checkpointing only lm_head's copy outlives
      the forward (the recomputed layers cast again, one at a time).
    - DDP at world > 1: the Reducer's flat buckets hold a second copy of the gradients in the weights'
      dtype, from construction (``gradient_as_bucket_view=False``; torch reducer.cpp ``initialize_buckets``).
    - ZeRO-3: the contiguous-gradient bucket (reduce_bucket_size elements, kept from init, stage3.py)
      and, at world > 1, the gathered module plus the prefetch bucket. ZeRO-1/2 buckets exist only in
      backward (:func:`step_bytes_per_rank`).
    - FSDP2: the unsharded compute-dtype copy of the tail unit (final norm and lm_head, or the tied embedding:
      ``reshard_after_forward=False``; an untied input embedding is a unit of its own, resharded after its forward,
      with ``embedding_unit`` (accelerate >= 1.15), else it stays in the root unit), of the current and the prefetched
      decoder layer, and the reduce-scatter input of one layer (fp32 reduce); shard-grad-op keeps every unit gathered.
    """
    c = lay.compute
    out = 0
    if lay.autocast:
        out += c * ((spec.lm_head_params or spec.embedding_params) if ckpt else _linear_params(spec))
    unit = spec.layer_params
    if s.is_ddp:
        return out + (trainable * lay.grads if world_size > 1 else 0), 0
    if s.is_deepspeed and not s.shards.params:  # ZeRO-1/2
        return out, 0
    if s.is_deepspeed:  # ZeRO-3
        out += DS_REDUCE_BUCKET_ELEMENTS * c
        gathered = (max(unit, spec.embedding_params) + min(DS_PREFETCH_BUCKET_ELEMENTS, spec.num_params)) * c
        return (out + gathered, gathered) if world_size > 1 else (out, 0)
    unit += padded  # FSDP2 gathers the padded rows too (fsdp_row_padding)
    reduce_input = unit * lay.grads if trainable == spec.num_params else 0
    if s.gathers_params:
        return out + (spec.num_params + padded * spec.num_layers) * c + reduce_input, reduce_input
    root = (
        (spec.lm_head_params or spec.embedding_params)
        if embedding_unit
        else spec.embedding_params + spec.lm_head_params
    )
    units = 2 * unit * c + reduce_input
    return out + root * c + units, units


# ---------------------------------------------------------------- allocator and overhead


def allocator_bytes(
    spec, s: Strategy, degree, trainable, lay: Dtypes, largest_transient: int, grads: int, ckpt: bool
) -> int:
    """Reserved beyond the peak allocated: torch's caching allocator never moves or returns blocks.

    c10/cuda/CUDACachingAllocator.cpp caches freed blocks per stream (``get_free_block`` only returns
    a block of the requesting stream) and splits cached blocks to serve smaller requests, so free space
    ends up scattered between live tensors. Counted:
    - one block of the largest transient tensor (the fp32 logits, or an MLP activation): a request
      that size needs one contiguous free block, which the earlier phases' scattered frees rarely are;
    - with activation checkpointing, the gradients allocated layer by layer in backward between the
      recomputed activations pin the blocks those activations freed;
    - blocks cached by communication streams, which the compute stream never reuses: FSDP2's sharded
      fp32 gradients come from reduce-scatter outputs on its reduce-scatter stream
      (``_fsdp_collectives.foreach_reduce``); ZeRO-2 builds its fp32 gradient partition, the bucket
      flatten and the per-parameter upcasts on the reduction stream (stage_1_and_2.py ``average_tensor``);
      ZeRO-3 flattens buckets and upcasts partitions there (stage3.py, ``reduce_scatter_coalesced``) and
      records the bf16 gradients in flight (up to the two overlapped buckets) on it before freeing them.
    """
    out = largest_transient
    if ckpt:
        out += grads
    bucket = min(DS_REDUCE_BUCKET_ELEMENTS, trainable)  # what a flatten of the gradients in it holds
    largest = min(max(spec.layer_params, spec.embedding_params), trainable) if spec.has_shape else 0
    if s.is_fsdp:
        out += _split(trainable * lay.grads, True, degree)
    elif s.zero_stage == 2:
        out += (
            _split(trainable * lay.grads, True, degree) + bucket * lay.compute + _split(largest * FP32, True, degree)
        )
    elif s.zero_stage == 3:
        out += bucket * lay.compute + _split(bucket * FP32, True, degree) + min(trainable, 2 * bucket) * lay.compute
    return out


def overhead_bytes(s: Strategy, world_size: int) -> int:
    """CUDA context and library workspaces, plus NCCL communicators when a process group is used."""
    nccl = world_size > 1 or s.is_deepspeed
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if nccl else 0)


# ---------------------------------------------------------------- public entry point


def estimate_memory(
    model_or_num_params: Any,
    strategy: str,
    world_size: int,
    *,
    nodes: int = 1,
    method: str = "full",
    offload: str = "none",
    optimizer: str = "adamw",
    master_weights: bool = True,
    param_bytes: int = 2,
    grad_bytes: int | None = None,
    seq_len: int = 2048,
    micro_batch_size: int = 1,
    activation_checkpointing: bool = False,
    lora_rank: int = 16,
    overhead: int | None = None,
    gradient_accumulation_steps: int = 1,
    use_liger_kernel: bool = False,
    attention: str | None = None,
    device: str = "cuda",
    base_bytes: int | None = None,
    tp_size: int = 1,
    cp_size: int = 1,
    sp_size: int = 1,
    offload_device: str = "cpu",
    lora_dropout: float = LORA_DROPOUT,
    checkpoint_children: bool = False,
    fsdp2_embedding_unit: bool = True,
    fused_lm_head: bool = False,
) -> MemoryEstimate:
    """Per-rank memory of training ``model_or_num_params`` with ``strategy`` on ``world_size`` ranks.

    ``model_or_num_params``: a parameter count (activations are then 0), a ModelSpec, a config,
    a model, a local folder / config.json or a hub name. Precision: ``param_bytes`` is the compute
    dtype (2 for bf16/fp16, 4 for fp32) and ``master_weights`` keeps fp32 master weights and optimizer
    state; ``param_bytes=2, master_weights=False`` is pure bf16 (see :func:`engine_dtypes`). ``grad_bytes``
    overrides the gradient dtype the strategy keeps. ``use_liger_kernel``: Liger's fused RMSNorm,
    SwiGLU, RoPE and linear cross-entropy (the ``TrainingArguments`` flag). ``attention``: the
    ``attn_implementation`` (default: the model's own, ``ModelSpec.attention``: eager where it refuses sdpa). ``device="cpu"``: no CUDA context or caching allocator (CPU ranks).
    ``base_bytes``: bytes per element of a LoRA/QLoRA model's frozen base as loaded (default: the
    compute dtype's; 4 for a model loaded in fp32). ``lora_dropout``: PEFT's dropout on each adapter's input (the
    recipes' 0.05 by default; 0 saves one copy of each adapter's input). ``overhead`` overrides the context term. ``gradient_accumulation_steps`` > 1 keeps gradients
    alive next to activations (see MemoryEstimate).

    Model parallelism (:class:`~hf_dist.planning.layout.Layout` checks the sizes): ``tp_size`` splits the linear
    weights, their gradients and optimizer state and the head / MLP activations
    (:meth:`~hf_dist.planning.modelinfo.ModelSpec.tensor_parallel_shard`); ``cp_size`` / ``sp_size`` split each
    sequence, so every activation and the logits, and widen the group the states are sharded over
    (``Layout.state_shard_size``). ``offload_device="nvme"`` keeps the offloaded states in swap files and counts
    DeepSpeed's pinned host buffers instead (:func:`cpu_bytes_per_rank`). ``checkpoint_children``: FSDP2's
    checkpointing wraps each child of a decoder layer (accelerate <= 1.14, ``LibraryFeatures``), saving each input.
    ``fsdp2_embedding_unit``: FSDP2 shards an untied input embedding as a unit of its own, resharded after forward
    (accelerate >= 1.15, ``LibraryFeatures``); otherwise it stays gathered in the root unit with ``lm_head``.
    ``fused_lm_head``: the loss runs through TRL's fused LM head (``SFTTrainer``), which never holds the logits
    (:func:`~hf_dist.planning.activations.trl_head_bytes`).
    """
    from hf_dist.planning.modelinfo import model_spec

    run = Layout(
        strategy, world_size, nodes, offload, activation_checkpointing,
        tp_size=tp_size, cp_size=cp_size, sp_size=sp_size, offload_device=offload_device,
    )  # fmt: skip
    s = run.strategy
    validate_args(run, method, optimizer, param_bytes, grad_bytes, lora_rank)
    check_positive_int("seq_len", seq_len)
    check_positive_int("micro_batch_size", micro_batch_size)
    check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    check_choice("device", device, DEVICES)
    spec = model_spec(model_or_num_params)
    attention = spec.attention if attention is None else attention
    check_choice("attention", attention, ATTENTIONS)
    run.check_model(spec, seq_len)
    whole, spec = spec, run.rank_spec(spec)
    keys, seq_len = seq_len, seq_len // run.seq_shards
    base_bytes = param_bytes if base_bytes is None else base_bytes
    if base_bytes not in (2, 4):
        raise ValueError(f"base_bytes must be 2 (bf16/fp16 weights) or 4 (fp32), got {base_bytes!r}")
    lay = engine_dtypes(s, param_bytes, master_weights, method, base_bytes)
    if grad_bytes is not None:
        lay = replace(lay, grads=grad_bytes)
    degree = run.state_shard_size
    trainable = trainable_params(spec, method, lora_rank)
    ckpt = activation_checkpointing
    act_kw = {"attention": attention, "liger": use_liger_kernel, "keys": keys}
    if checkpoint_children and s.is_fsdp:  # accelerate <= 1.14 (LibraryFeatures.fsdp2_checkpoints_children)
        act_kw["checkpoint_children"] = True
    if method != "full":  # fp32 adapters under DDP's autocast: each casts its input to fp32 and back (a copy each)
        cast = s.is_ddp and lay.weights == FP32 and lay.compute < FP32
        act_kw["lora"] = Lora(lora_rank, dropout=lora_dropout > 0, cast=cast)
    params = param_bytes_per_rank(spec, s, degree, method, offload, lay, base_bytes, lora_rank)
    grads = grad_bytes_per_rank(s, degree, trainable, offload, lay, gradient_accumulation_steps)
    padded, padded_unit = fsdp_row_padding(spec, degree) if s.is_fsdp and offload == "none" else (0, 0)
    if run.tp_size > 1 and method == "full" and not s.shards.grads:
        # the vocabulary-parallel embedding (embedding_rowwise) gets a replicated, full-vocabulary gradient
        # (DTensor Replicate, measured on 2 TP ranks), not its shard
        grads += (whole.embedding_params - spec.embedding_params) * lay.grads
    optim = optimizer_bytes_per_rank(s, degree, trainable, offload, optimizer, lay)
    if padded:  # every sharded state of the padded rows; the routed experts are trainable only in full fine-tuning
        full = method == "full"
        params += padded * (lay.weights if full else base_bytes)
        grads += padded * lay.grads if full and s.shards.grads and gradient_accumulation_steps == 1 else 0
        optim += padded * (optimizer_state_bytes(optimizer, lay.state) + lay.master) if full else 0
    acts, recompute = activation_bytes(spec, seq_len, micro_batch_size, ckpt, lay, **act_kw)
    last_layer = recompute if ckpt else (acts // spec.num_layers if spec.num_layers else 0)
    if not spec.has_shape:
        head = 0
    elif fused_lm_head:
        tokens = seq_len * micro_batch_size
        gathered = lay.compute if s.is_fsdp else lay.weights  # FSDP2 gathers the head in its param dtype
        head = trl_head_bytes(
            spec, tokens, lay, trains_head=method == "full", weight_bytes=gathered, liger=use_liger_kernel
        )
    else:
        head = logits_bytes(spec, seq_len, micro_batch_size, lay, liger=use_liger_kernel)
    buffers, units = buffer_bytes(
        spec, s, world_size // run.tp_size, trainable, lay, ckpt, padded_unit, embedding_unit=fsdp2_embedding_unit
    )
    step = step_bytes_per_rank(spec, s, degree, trainable, offload, lay)
    nvme = run.offload_device == "nvme"
    cpu = cpu_bytes_per_rank(spec, degree, trainable, method, offload, optimizer, lay, param_bytes, nvme, device)
    swap = (
        swap_bytes_per_rank(spec, degree, trainable, method, offload, optimizer, lay, param_bytes, device)
        if nvme
        else 0
    )
    on_gpu = device == "cuda"
    allocator = 0
    if on_gpu:
        largest = largest_transient_bytes(spec, seq_len, micro_batch_size, lay, use_liger_kernel, fused_lm_head)
        allocator = allocator_bytes(spec, s, degree, trainable, lay, largest, grads, ckpt)
    fixed = int(overhead) if overhead is not None else (overhead_bytes(s, world_size) if on_gpu else 0)
    overlap = not grads_persist(s, lay, gradient_accumulation_steps)
    layer_grads = (
        layer_gradient_bytes(spec, seq_len, micro_batch_size, lay, liger=use_liger_kernel) if spec.has_shape else 0
    )
    return MemoryEstimate(
        params,
        grads,
        optim,
        acts,
        buffers,
        fixed,
        cpu,
        overlap,
        head,
        step,
        allocator,
        recompute,
        units,
        last_layer,
        layer_grads,
        swap,
    )


def fsdp_row_padding(spec, degree: int) -> tuple[int, int]:
    """Elements FSDP2's dim-0 sharding adds: ``(per rank, per gathered decoder layer)``.

    ``fully_shard`` splits every parameter into ``degree`` chunks along dim 0 (``torch.chunk``) and pads each rank's
    shard to ``ceil(rows / degree)`` rows (torch ``_fsdp_param.py``), and the all-gather returns the padded whole.
    Dense weights have thousands of rows, so only transformers' stacked routed experts, ``(experts, out, in)``
    tensors, are padded measurably: with more ranks than experts every rank holds a whole expert's rows (8 experts
    over 64 ranks: 8x their share). Found by tracing Mixtral 8x7B on 64 ranks.
    """
    if not spec.experts or degree <= spec.experts and spec.experts % degree == 0:
        return 0, 0
    per_layer = 3 * spec.hidden_size * spec.intermediate_size  # one expert: gate, up, down
    rows = math.ceil(spec.experts / degree)
    per_rank = spec.num_layers * rows * per_layer - math.ceil(spec.num_layers * spec.experts * per_layer / degree)
    return max(per_rank, 0), (rows * degree - spec.experts) * per_layer
