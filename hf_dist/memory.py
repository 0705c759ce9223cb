"""Per-rank training memory by component: pure arithmetic, no I/O, no GPU.

Sources (each formula below names the one it follows):
- Model states: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (2020), sec. 3.1: mixed-precision Adam keeps 2 (fp16/bf16 params) + 2 (grads) + 12 (fp32
  master copy, momentum, variance) bytes per parameter; stage 1/2/3 divide the optimizer state /
  + gradients / + parameters by the data-parallel degree.
- Activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (2022), eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer for a GPT block in 16-bit. We re-derive the
  same tensor-by-tensor count for the Llama block (see ``layer_activation_bytes``).
- Buffers: the defaults of the installed libraries (cited where used).

Units: every function returns bytes (``_bytes`` in its name) for ONE rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "hsdp")
OFFLOADS = ("none", "optimizer", "optimizer+params")
METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")

GIB = 1024**3

# Which strategies may offload what. FSDP2's CPUOffloadPolicy moves parameters, gradients and the
# optimizer step together, so FSDP has no optimizer-only offload; DDP offloads nothing.
ALLOWED_OFFLOADS = {
    "ddp": ("none",),
    "zero1": ("none", "optimizer"),
    "zero2": ("none", "optimizer"),
    "zero3": ("none", "optimizer", "optimizer+params"),
    "fsdp_full_shard": ("none", "optimizer+params"),
    "fsdp_shard_grad_op": ("none",),  # it keeps the full parameters gathered, so offloading them gains nothing
    "hsdp": ("none", "optimizer+params"),
}

# torch DDP: bucket_cap_mb defaults to 25 MiB (torch/nn/parallel/distributed.py). The Reducer keeps a
# flat bucket tensor for every gradient unless gradient_as_bucket_view=True (accelerate and the
# Trainer leave it False), i.e. a second full copy of the gradients lives in the buckets.
DDP_BUCKET_CAP_BYTES = 25 * 1024**2
# deepspeed/runtime/zero/config.py (0.19): reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7,
# stage3_param_persistence_threshold 1e5 elements. The reduce bucket is allocated at its full size
# whatever the model size (measured: +2.0 GB for a 7M-param fp32 model, benchmarks/planner_accuracy.py).
DS_REDUCE_BUCKET_ELEMENTS = int(5e8)
DS_PREFETCH_BUCKET_ELEMENTS = int(5e7)
# CUDA context (~0.5 GiB on Hopper with CUDA 12) + NCCL communicator buffers (~0.5 GiB), measured
# order of magnitude on H100; plus 5% of everything else for caching-allocator fragmentation.
CUDA_FIXED_OVERHEAD_BYTES = 1 * GIB
FRAGMENTATION = 0.05
# QLoRA (Dettmers et al. 2023, sec. 3): NF4 = 4 bits/param; double quantisation stores one 8-bit absmax
# per 64 params plus one fp32 constant per 256 blocks = 8/64 + 32/(64*256) = 0.127 bits/param.
QLORA_BASE_BYTES_PER_PARAM = 0.5 + (8 / 64 + 32 / (64 * 256)) / 8
# LoRA targets: every attention and MLP projection of every decoder layer
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by component; ``total`` is the predicted peak.

    ``cpu`` is host memory per rank used by offloaded states. ``grads_overlap_activations``: with one
    micro-batch per optimizer step and gradients freed after it (``zero_grad(set_to_none=True)``, the
    Trainer's default), gradients only appear in backward while activations are being freed, so the
    peak holds the larger of the two, not both (measured: benchmarks/planner_accuracy.py). With
    gradient accumulation the gradients persist through the next forward and both count.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int
    cpu: int = 0
    grads_overlap_activations: bool = False

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        if self.grads_overlap_activations:
            transient = max(self.grads, self.activations)
        else:
            transient = self.grads + self.activations
        return self.params + self.optimizer + transient + self.buffers + self.overhead

    def to_dict(self) -> dict[str, int]:
        keys = ("params", "grads", "optimizer", "activations", "buffers", "overhead", "cpu", "model_states", "total")
        return {k: int(getattr(self, k)) for k in keys}

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.to_dict().items()}


# ---------------------------------------------------------------- validation


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def validate_args(strategy, world_size, nodes, method, offload, optimizer, param_bytes, grad_bytes, lora_rank) -> None:
    """Raise ValueError naming the bad argument, the allowed values and the fix."""
    _choice("strategy", strategy, STRATEGIES)
    _choice("offload", offload, OFFLOADS)
    _choice("method", method, METHODS)
    _choice("optimizer", optimizer, OPTIMIZERS)
    _positive_int("world_size", world_size)
    _positive_int("nodes", nodes)
    _positive_int("lora_rank", lora_rank)
    if world_size % nodes:
        raise ValueError(f"world_size ({world_size}) is not divisible by nodes ({nodes}); use the same GPUs per node")
    if strategy == "hsdp" and nodes < 2:
        raise ValueError("hsdp replicates across nodes and needs nodes >= 2; use fsdp_full_shard on a single node")
    if offload not in ALLOWED_OFFLOADS[strategy]:
        raise ValueError(
            f"strategy {strategy!r} does not support offload {offload!r}; allowed: {', '.join(ALLOWED_OFFLOADS[strategy])}"
            " (FSDP2 offloads parameters and optimizer together; use a ZeRO strategy for optimizer-only offload)"
        )
    if method == "qlora" and offload != "none":
        raise ValueError(f"qlora keeps 4-bit base weights on the GPU; offload must be 'none', got {offload!r}")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        if value not in (1, 2, 4):
            raise ValueError(f"{name} must be 1, 2 or 4 bytes per element, got {value!r}")


# ---------------------------------------------------------------- parameters


def lora_trainable_params(spec, rank: int) -> int:
    """LoRA params: rank * (in + out) for q,k,v,o,gate,up,down of every decoder layer (Hu et al. 2021)."""
    if not spec.has_shape:
        raise ValueError("LoRA/QLoRA estimates need the model's shape; pass a config, folder or model, not a count")
    h, inter = spec.hidden_size, spec.intermediate_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    per_layer = rank * ((h + q_out) + 2 * (h + kv_out) + (q_out + h) + 2 * (h + inter) + (inter + h))
    return per_layer * spec.num_layers


def trainable_params(spec, method: str, lora_rank: int) -> int:
    return spec.num_params if method == "full" else lora_trainable_params(spec, lora_rank)


def base_weight_bytes(spec, method: str, param_bytes: int) -> float:
    """Bytes of the (frozen or trained) base weights on one full replica."""
    if method != "qlora":
        return spec.num_params * param_bytes
    # bitsandbytes quantises the Linear layers; embeddings and lm_head stay in 16-bit
    unquantised = spec.embedding_params + spec.lm_head_params
    return (spec.num_params - unquantised) * QLORA_BASE_BYTES_PER_PARAM + unquantised * param_bytes


def optimizer_bytes_per_param(optimizer: str, master_weights: bool) -> int:
    """ZeRO paper sec. 3.1: Adam = fp32 momentum + variance (8) + fp32 master copy (4) = 12 bytes."""
    states = {"adamw": 8, "adamw_8bit": 2, "sgd": 4}[optimizer]  # 8-bit Adam: 1 byte per moment (bitsandbytes)
    return states + (4 if master_weights else 0)


def shard_degree(strategy: str, world_size: int, nodes: int) -> int:
    """Ranks over which sharded states are split (HSDP shards inside a node, replicates across nodes)."""
    if strategy == "ddp":
        return 1
    return world_size // nodes if strategy == "hsdp" else world_size


# which of (params, grads, optimizer) each strategy shards (ZeRO paper fig. 1). Shard-grad-op keeps
# the full 16-bit parameters from forward until the end of backward, so its peak matches ZeRO-2.
SHARDED = {
    "ddp": (False, False, False),
    "zero1": (False, False, True),
    "zero2": (False, True, True),
    "zero3": (True, True, True),
    "fsdp_full_shard": (True, True, True),
    "fsdp_shard_grad_op": (False, True, True),
    "hsdp": (True, True, True),
}


def param_bytes_per_rank(spec, strategy, degree, method, offload, param_bytes, lora_rank) -> int:
    if offload == "optimizer+params":
        return 0
    full = base_weight_bytes(spec, method, param_bytes)
    if method != "full":
        full += trainable_params(spec, method, lora_rank) * param_bytes
    return math.ceil(full / degree) if SHARDED[strategy][0] else math.ceil(full)


def grad_bytes_per_rank(strategy, degree, trainable, offload, grad_bytes, accumulation=1) -> int:
    # DeepSpeed's ZeRO-1 (stage_1_and_2.py) reduces into gradient partitions at the end of backward, so
    # with one micro-batch per step only the partition survives (measured equal to ZeRO-2); with
    # accumulation it keeps the full gradients between micro-batches, as in the ZeRO paper.
    sharded = SHARDED[strategy][1] or (strategy == "zero1" and accumulation == 1)
    # ZeRO-Offload keeps gradient partitions in pinned host memory (stage 2/3); FSDP2 offload too
    if offload != "none" and sharded:
        return 0
    return math.ceil(trainable * grad_bytes / degree) if sharded else trainable * grad_bytes


def optimizer_bytes_per_rank(strategy, degree, trainable, offload, optimizer, master_weights) -> int:
    if offload != "none":
        return 0
    full = trainable * optimizer_bytes_per_param(optimizer, master_weights)
    return math.ceil(full / degree) if SHARDED[strategy][2] else full


def cpu_bytes_per_rank(spec, strategy, degree, trainable, method, offload, optimizer, master_weights, pb, gb) -> int:
    """Host memory per rank holding offloaded states (fp32 gradients on the host for ZeRO-Offload)."""
    if offload == "none":
        return 0
    states = trainable * (optimizer_bytes_per_param(optimizer, master_weights) + max(gb, 4))
    if offload == "optimizer+params":
        states += base_weight_bytes(spec, method, pb)
    return math.ceil(states / degree)


# ---------------------------------------------------------------- activations


def layer_activation_bytes(spec, seq_len: int, micro_batch_size: int, act_bytes: int) -> int:
    """Saved-for-backward bytes of one Llama-style decoder layer.

    Korthikanti et al. eq. 1 counts, per token, 34*h bytes (16-bit) for a GPT layer plus 5*a*s bytes
    for the attention score/softmax/dropout matrices. Re-deriving the same count for a Llama block
    (HF implementation, SDPA / flash attention, no dropout), per token:
      attention: norm output h, q / rotate_half(q) / rotated q = 3h, k likewise 3*kv, v kv,
                 attention output h  -> 5h + 4kv elements; flash attention keeps only a fp32
                 log-sum-exp per head (4a bytes) instead of the a*s score matrix;
      SwiGLU MLP: norm output h, gate, silu(gate), up, gate*up = 4I  -> h + 4I elements;
      2 RMSNorms: the weight multiply keeps its 16-bit input (2h elements) and the fp32 upcast of the
                  input (4 bytes * h each, 8h bytes).
    With I=4h, kv=h this gives 2*(28h) + 8h = 64h bytes: more than GPT's 34h because SwiGLU keeps
    four I-sized tensors where GELU keeps two.
    """
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    elements = 8 * h + 4 * kv + 4 * spec.intermediate_size
    per_token = elements * act_bytes + 2 * 4 * h + 4 * spec.num_attention_heads
    return per_token * seq_len * micro_batch_size


def logits_bytes(spec, seq_len: int, micro_batch_size: int, act_bytes: int) -> int:
    """Logits and the loss: transformers upcasts logits to fp32 and cross-entropy keeps fp32 log-softmax."""
    per_token = act_bytes + 4 + (4 if act_bytes < 4 else 0)  # 16-bit logits, fp32 copy, fp32 log-softmax
    return spec.vocab_size * per_token * seq_len * micro_batch_size


def activation_bytes(spec, seq_len, micro_batch_size, activation_checkpointing, act_bytes) -> int:
    """Peak saved activations per rank. Data parallelism does not split them: each rank runs its micro-batch.

    With activation checkpointing (Korthikanti sec. 4: "full recomputation") only each layer's input
    (s*b*h elements) is kept, plus one layer's activations while it is recomputed in backward.
    """
    if not spec.has_shape:
        return 0
    layer = layer_activation_bytes(spec, seq_len, micro_batch_size, act_bytes)
    head = logits_bytes(spec, seq_len, micro_batch_size, act_bytes)
    if activation_checkpointing:
        inputs = spec.num_layers * spec.hidden_size * seq_len * micro_batch_size * act_bytes
        return inputs + layer + head
    return spec.num_layers * layer + head


# ---------------------------------------------------------------- buffers


def buffer_bytes(spec, strategy, trainable, offload, param_bytes, grad_bytes) -> int:
    """Temporary communication / gather buffers per rank."""
    unit = spec.layer_params
    if strategy == "ddp":
        # DDP Reducer's flat buckets hold a full gradient copy (gradient_as_bucket_view=False)
        return trainable * grad_bytes
    if strategy in ("zero1", "zero2"):
        return DS_REDUCE_BUCKET_ELEMENTS * grad_bytes
    if strategy == "zero3":
        # the module being run + the prefetch bucket are gathered; the largest module may be the
        # (untied) lm_head or the embedding rather than a decoder layer
        largest = max(unit, spec.embedding_params)
        live = largest + min(DS_PREFETCH_BUCKET_ELEMENTS, spec.num_params)
        return live * param_bytes + DS_REDUCE_BUCKET_ELEMENTS * grad_bytes
    # FSDP2: the root unit (embedding, final norm, lm_head) stays gathered from forward to backward
    # (FSDP2 sets reshard_after_forward=False on the root), plus the current and the prefetched
    # decoder layer, plus one layer's unsharded gradients before reduce-scatter.
    root = spec.embedding_params + spec.lm_head_params
    unit_grads = unit * grad_bytes if trainable == spec.num_params else 0
    if strategy == "fsdp_shard_grad_op":
        return unit_grads
    return (root + 2 * unit) * param_bytes + unit_grads


def overhead_bytes(other_bytes: int) -> int:
    return CUDA_FIXED_OVERHEAD_BYTES + int(FRAGMENTATION * other_bytes)


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
    grad_bytes: int = 2,
    seq_len: int = 2048,
    micro_batch_size: int = 1,
    activation_checkpointing: bool = False,
    lora_rank: int = 16,
    overhead: int | None = None,
    gradient_accumulation_steps: int = 1,
) -> MemoryEstimate:
    """Per-rank memory of training ``model_or_num_params`` with ``strategy`` on ``world_size`` ranks.

    ``model_or_num_params``: a parameter count (activations are then 0), a ModelSpec, a config,
    a model, a local folder / config.json or a hub name. ``overhead``: fixed framework bytes; the
    default is the CUDA context + NCCL (1 GiB) + 5% fragmentation; pass 0 for CPU accounting.
    ``gradient_accumulation_steps`` > 1 keeps gradients alive next to activations (see MemoryEstimate).
    """
    from hf_dist.modelinfo import model_spec

    validate_args(strategy, world_size, nodes, method, offload, optimizer, param_bytes, grad_bytes, lora_rank)
    _positive_int("seq_len", seq_len)
    _positive_int("micro_batch_size", micro_batch_size)
    _positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    spec = model_spec(model_or_num_params)
    degree = shard_degree(strategy, world_size, nodes)
    trainable = trainable_params(spec, method, lora_rank)
    params = param_bytes_per_rank(spec, strategy, degree, method, offload, param_bytes, lora_rank)
    grads = grad_bytes_per_rank(strategy, degree, trainable, offload, grad_bytes, gradient_accumulation_steps)
    optim = optimizer_bytes_per_rank(strategy, degree, trainable, offload, optimizer, master_weights)
    acts = activation_bytes(spec, seq_len, micro_batch_size, activation_checkpointing, param_bytes)
    buffers = buffer_bytes(spec, strategy, trainable, offload, param_bytes, grad_bytes) if world_size > 1 else 0
    overlap = gradient_accumulation_steps == 1
    peak = params + optim + buffers + (max(grads, acts) if overlap else grads + acts)
    fixed = overhead_bytes(peak) if overhead is None else int(overhead)
    cpu = cpu_bytes_per_rank(
        spec, strategy, degree, trainable, method, offload, optimizer, master_weights, param_bytes, grad_bytes
    )
    return MemoryEstimate(params, grads, optim, acts, buffers, fixed, cpu, overlap)
