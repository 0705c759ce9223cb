"""What a rank holds beyond its model states and activations: working copies and communication buffers, the
optimizer step's transients, the caching allocator's reserve and the memory outside torch's allocator.

Units: every function returns bytes (``_bytes`` in its name) for ONE rank.
"""

from __future__ import annotations

from hf_dist.planning.dtypes import FP32, GIB, Dtypes
from hf_dist.planning.layout import Strategy
from hf_dist.planning.model_states import bf16_optimizer, shard_bytes
from hf_dist.planning.moe import zero3_leaf_block_params

# deepspeed/runtime/zero/config.py defaults, which hf_dist's DeepSpeed JSON writes out explicitly
# (hf_dist/configs/deepspeed.py) so that plan and config agree: reduce_bucket_size 5e8 elements,
# stage3_prefetch_bucket_size 5e7. The reduce buckets are allocated at their full size whatever the
# model size (measured on CPU ranks: +2.0 GB for a 7M-parameter fp32 model, benchmarks/planner_accuracy.py).
DS_REDUCE_BUCKET_ELEMENTS = int(5e8)
DS_PREFETCH_BUCKET_ELEMENTS = int(5e7)
DS_SUB_GROUP_ELEMENTS = int(1e9)
# stage3_max_live_parameters (DeepSpeed's default, written out by hf_dist's JSON): ZeRO-3 prefetches while fewer
# elements than this are gathered, and keeps gathered what it will reuse within stage3_max_reuse_distance (also 1e9)
DS_MAX_LIVE_PARAMETERS = int(1e9)
DS_MAX_REUSE_DISTANCE = int(1e9)  # stage3_max_reuse_distance (DeepSpeed's default, written out by hf_dist's JSON)
# engine.py MEMORY_OPT_ALLREDUCE_SIZE: the elements per flat bucket of buffered_allreduce_fallback
DS_ALLREDUCE_BUCKET_ELEMENTS = int(5e8)
# Outside torch's allocator, measured as device_used - max_memory_reserved on an H100 (torch 2.11,
# CUDA 13; ../shared/gpu): 1.30 GiB in every single-process case (CUDA context, cuBLAS/cuBLASLt
# workspaces, loaded kernel images), 0.38 GiB more once NCCL communicators exist (the DeepSpeed cases,
# which create them even on one GPU). Other GPUs and CUDA versions land within a few hundred MiB.
CUDA_CONTEXT_BYTES = int(1.30 * GIB)
NCCL_BYTES = int(0.38 * GIB)


def step_bytes_per_rank(spec, s: Strategy, degree, trainable, offload, lay: Dtypes) -> int:
    """Transients of the end of backward and the optimizer step, which coexist with the gradients.

    The Trainer's default optimizer on CUDA is ``adamw_torch_fused``: no state-sized temporaries.
    DeepSpeed (bf16, fp32 accumulation):
    - ZeRO-1 (``BF16_Optimizer``): the bf16 autograd gradients, from backward until the engine's
      ``zero_grad`` after the step sets them to None (engine.py ``_take_model_step`` -> bf16_optimizer.py
      ``zero_grad(set_to_none=True)``), and the larger of the fp32 upcast of the largest one (``_update_hp_grad``)
      and the all-reduce at the accumulation boundary (:func:`bf16_allreduce_bytes`);
    - ZeRO-1/2 in stage_1_and_2.py: the contiguous-gradient buckets (reduce_bucket_size elements, two
      with overlap_comm), allocated at the first gradient hook of each backward and freed at its end;
      fp64 norm temporaries of the largest parameter's partition (``get_grad_norm_direct``);
    - ZeRO-3: the flattened fp32 gradient of one sub-group (sub_group_size 1e9 elements) in ``step``
      and the same fp64 norm temporaries.
    """
    if not s.is_deepspeed or offload != "none":
        return 0
    largest = min(max(spec.layer_params, spec.embedding_params), trainable) if spec.has_shape else 0
    norm = shard_bytes(largest * 8, True, degree)
    if bf16_optimizer(s, lay):
        return trainable * lay.compute + max(largest * FP32, bf16_allreduce_bytes(spec, trainable, lay))
    if s.zero_stage in (1, 2):
        buckets = 2 if s.zero_stage == 2 and lay.compute < FP32 else 1  # overlap_comm (hf_dist: stage >= 2)
        return buckets * DS_REDUCE_BUCKET_ELEMENTS * lay.compute + norm
    return min(DS_SUB_GROUP_ELEMENTS, shard_bytes(trainable, True, degree)) * FP32 + norm


def bf16_allreduce_bytes(spec, trainable: int, lay: Dtypes) -> int:
    """``BF16_Optimizer``'s all-reduce of its fp32 gradients (engine.py ``buffered_allreduce_fallback`` ->
    ``allreduce_no_retain`` -> ``allreduce_bucket``): the flat fp32 gradient of each parameter group, grouped into
    buckets that close once they pass ``MEMORY_OPT_ALLREDUCE_SIZE`` elements, each flattened (a bucket of several
    groups is concatenated, one group is a view) and cast to the communication dtype. The Trainer's two groups
    (weight decay, and the norms without it) share a bucket only when the model is smaller than one: full
    fine-tuning below 5e8 parameters; LoRA has no norm group."""
    full = trainable == spec.num_params
    concatenated = trainable * FP32 if full and trainable <= DS_ALLREDUCE_BUCKET_ELEMENTS else 0
    return concatenated + trainable * lay.compute


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
      and, at world > 1, its gathered parameters (:func:`zero3_gathered_bytes`), which are not a unit released
      around the loss as FSDP2's are. ZeRO-1/2 buckets exist only in backward (:func:`step_bytes_per_rank`).
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
        return out + DS_REDUCE_BUCKET_ELEMENTS * c + zero3_gathered_bytes(spec, s, world_size, lay, ckpt), 0
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


def zero3_gathered_bytes(spec, s: Strategy, world_size: int, lay: Dtypes, ckpt: bool = False) -> int:
    """ZeRO-3's gathered parameters, alive through forward and backward (the loss's logits included) and released
    before the optimizer step (stage3.py ``step`` -> ``_partition_all_parameters``).

    partitioned_param_coordinator.py: after its first step (the recorded trace) ZeRO-3 prefetches upcoming parameters
    while fewer than ``stage3_max_live_parameters`` elements are gathered (``fetch_sub_module``), and a module's
    release keeps every parameter it will use again within ``stage3_max_reuse_distance`` elements of the trace
    (``__params_to_release``; with checkpointing the last layers run again right after the loss). So up to
    ``stage3_max_live_parameters`` elements stay gathered, 16-bit: traced 0.96e9 (Llama 3 8B) and 1.01e9 (Llama 3.2
    1B) elements at the loss on 64 ranks; a smaller model keeps all of its parameters gathered. The module being run
    is fetched whole whatever the limit: transformers' stacked experts are one module (Mixtral: 1.41e9 elements per
    layer). Where the MoE block is a ZeRO-3 leaf (:func:`~hf_dist.planning.moe.zero3_leaf_block_params`) the last
    layer's block stays gathered across the loss, and so do the other parameters of the last
    :func:`zero3_reused_layers` layers: traced at the peak of Mixtral on 64 ranks, layer 31's block (1.409e9) and the
    attention of layers 26-31 (6 x 4.19e7), 1.66e9 elements."""
    if not (s.is_deepspeed and s.shards.params) or world_size == 1:
        return 0
    leaf = zero3_leaf_block_params(spec)
    kept = leaf + zero3_reused_layers(spec, ckpt) * (spec.layer_params - leaf) if leaf else 0
    return min(spec.num_params, max(DS_MAX_LIVE_PARAMETERS, largest_module_params(spec), kept)) * lay.compute


def zero3_reused_layers(spec, ckpt: bool) -> int:
    """How many of the last decoder layers keep their parameters outside the leaf MoE block gathered from their forward
    to their backward (0 where the block is not a ZeRO-3 leaf).

    ``partitioned_param_coordinator.py __params_to_release`` keeps a released module's parameters when they occur again
    within ``stage3_max_reuse_distance`` elements of the module trace, counting each later module's
    ``iter_params(module, recurse=z3_leaf_module(submodule_to_release))``: for a module that is not a leaf (attention,
    norms) only each module's own parameters, so a leaf MoE block, whose parameters are its children's, counts 0. From
    a layer's forward to its next use -- its recompute in backward under checkpointing, else its backward -- the scan
    passes the later layers' forward, the LM head twice (forward, then backward) and the later layers' recompute and
    backward: ``j`` layers from the end are reused within the distance while ``j * (2 or 3) * other + 2 * head`` is
    below it. Mixtral 8x7B with checkpointing: (1e9 - 2 x 1.31e8) / (3 x 4.19e7) -> layers 26-31 (traced)."""
    leaf = zero3_leaf_block_params(spec)
    other = spec.layer_params - leaf  # a layer's parameters the scan counts: attention and norms
    budget = DS_MAX_REUSE_DISTANCE - 2 * (spec.lm_head_params or spec.embedding_params)
    if not leaf or other <= 0 or budget <= 0:
        return 0
    return min(spec.num_layers, (budget - 1) // ((3 if ckpt else 2) * other) + 1)


def largest_module_params(spec) -> int:
    """The most parameters one module holds directly (what ZeRO-3 fetches at once): the embedding or LM head, or a
    mixture-of-experts layer's stacked experts (gate/up and down projections of every expert)."""
    experts = spec.experts * 3 * spec.hidden_size * spec.intermediate_size if spec.experts else 0
    return max(spec.embedding_params, spec.lm_head_params, experts)


# ---------------------------------------------------------------- allocator and overhead


def compute_stream_reserve_bytes(largest_transient: int, grads: int, ckpt: bool) -> int:
    """The compute stream's free blocks at the peak, estimated without the allocation sequence (reserved beyond the
    peak allocated: torch's caching allocator never moves or returns blocks; with the sequence, a trace replays it
    instead: :mod:`hf_dist.tracing.allocations`).

    c10/cuda/CUDACachingAllocator.cpp serves a request from the smallest cached block that holds it and splits it, and
    never merges blocks of different segments (:mod:`hf_dist.planning.allocator`), so free space ends up scattered
    between live tensors. Counted:
    - one block of the largest transient tensor (the fp32 logits, or an MLP activation): a request that size needs
      one contiguous free block, which the earlier phases' scattered frees rarely are;
    - with activation checkpointing, the gradients allocated layer by layer in backward between the recomputed
      activations pin the blocks those activations freed.
    How far this is from the replayed sequence, run by run: docs/measurements.md, "The caching allocator's reserve
    against real GPUs".
    """
    return largest_transient + (grads if ckpt else 0)


def lora_input_cast_bytes(tokens: int, in_features: tuple[int, ...], cast: bool) -> int:
    """The largest tensor LoRA's adapters make and free: with fp32 adapters under autocast (DDP) PEFT's
    ``_cast_input_dtype`` copies each adapter's input to the adapter's fp32 (peft ``tuners/lora/layer.py``
    ``Linear.forward``), ``4 * tokens * in_features`` bytes, freed once the adapter's output is added -- down_proj's,
    whose input is the MLP's width, is twice the 16-bit MLP activation. 0 without the cast."""
    return FP32 * tokens * max(in_features, default=0) if cast else 0


def comm_stream_reserve_bytes(spec, s: Strategy, degree, trainable, lay: Dtypes) -> int:
    """Blocks cached by communication streams, which the compute stream never reuses (``get_free_block`` only returns
    a block of the requesting stream, CUDACachingAllocator.cpp):
    - FSDP2's sharded fp32 gradients come from reduce-scatter outputs on its reduce-scatter stream
      (``_fsdp_collectives.foreach_reduce``);
    - ZeRO-2 builds its fp32 gradient partition, the bucket flatten and the per-parameter upcasts on the reduction
      stream (stage_1_and_2.py ``average_tensor``);
    - ZeRO-3 flattens buckets and upcasts partitions there (stage3.py, ``reduce_scatter_coalesced``) and records the
      bf16 gradients in flight (up to the two overlapped buckets) on it before freeing them.
    """
    bucket = min(DS_REDUCE_BUCKET_ELEMENTS, trainable)  # what a flatten of the gradients in it holds
    largest = min(max(spec.layer_params, spec.embedding_params), trainable) if spec.has_shape else 0
    if s.is_fsdp:
        return shard_bytes(trainable * lay.grads, True, degree)
    if s.zero_stage == 2:
        return (
            shard_bytes(trainable * lay.grads, True, degree)
            + bucket * lay.compute
            + shard_bytes(largest * FP32, True, degree)
        )
    if s.zero_stage == 3:
        in_flight = min(trainable, 2 * bucket) * lay.compute
        return bucket * lay.compute + shard_bytes(bucket * FP32, True, degree) + in_flight
    return 0


def overhead_bytes(s: Strategy, world_size: int) -> int:
    """CUDA context and library workspaces, plus NCCL communicators when a process group is used."""
    nccl = world_size > 1 or s.is_deepspeed
    return CUDA_CONTEXT_BYTES + (NCCL_BYTES if nccl else 0)
