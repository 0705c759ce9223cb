"""Time per optimizer step of a candidate layout: pure arithmetic, used to rank what fits.

A micro-step costs its matrix FLOPs at a fraction of the device's dense peak (the linear layers' at the GEMMs',
the attention matmuls' at the flash kernels': :func:`compute_seconds_per_token`), the element-wise
traffic around the saved activations at memory bandwidth, and eager PyTorch's per-op CPU dispatch;
an optimizer step adds the optimizer's and the gradient clipping's memory traffic (:func:`optimizer_step_bytes`),
the collectives (:func:`comm_seconds`) and the PCIe traffic of offload. What this captures, and what the planner
needs from it:

- recompute: activation checkpointing runs every decoder layer's forward again: 2 FLOPs per layer weight per token,
  frozen or not (a LoRA base, which skips its weight gradients, pays half as much again, full fine-tuning a third),
  the attention forward, and the forward's traffic and ops;
- attention: causal flash attention computes half the score matrix, and its backward five matmuls to forward's two;
- micro-batch size: the per-op dispatch and the optimizer step are paid per micro-step / per step,
  whatever the tokens, so small micro-batches leave the GPU idle (measured on an H100: 28.1 us per
  token at 4096 tokens per micro-step, 24.9 at 8192; ../shared/gpu);
- Liger kernels: fused RMSNorm / SwiGLU / RoPE and the fused linear cross-entropy save fewer
  activations (less traffic, hf_dist.planning.memory) in fewer ops.

Absolute figures are estimates (the planner reports them as such); the ranking is what they are for.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist.planning.flops import attention_flops_per_token, matmul_flops_per_token
from hf_dist.planning.hardware import Hardware, memory_gbps_for, peak_tflops_for
from hf_dist.planning.layout import Strategy, strategy

# Dense bf16 GEMMs of transformer shapes reach about half of the datasheet peak in eager PyTorch
# training (MFU of well-tuned dense training on H100/A100 is 40-55%).
GEMM_EFFICIENCY = 0.5
# Flash attention (sdpa's FlashAttention-2 kernels) forward + backward: 35 % of an H100's dense bf16 peak, which its
# kernels do not reach for want of Hopper's asynchronous tensor-core instructions (Shah et al. 2024, "FlashAttention-3",
# sec. 1); 50-73 % of an A100's (Dao 2023, "FlashAttention-2", sec. 4.1: the low end taken).
FLASH_EFFICIENCY_HOPPER = 0.35
FLASH_EFFICIENCY_OTHER = 0.5
HOPPER = ("H100", "H200", "H800", "H20", "GH200")
# A decoder layer's forward is about a third of its ops (backward runs about two per forward op): checkpointing's
# recompute dispatches that third again.
RECOMPUTED_OPS_FRACTION = 1 / 3
# Each saved activation is written in forward and read back in backward, and the element-wise ops
# around it read and write it about once more each way: ~4 bytes of traffic per byte saved.
TRAFFIC_PER_SAVED_BYTE = 4.0
# Eager PyTorch spends ~10 us of CPU per op (dispatcher, autograd, kernel launch); a Llama decoder
# layer runs ~50 ops forward and ~100 backward in transformers' implementation; Liger's fused RMSNorm,
# RoPE and SwiGLU replace ~25 of the forward ones (and their backward ops).
DISPATCH_S = 10e-6
OPS_PER_LAYER = 150
OPS_PER_LAYER_LIGER = 90
# PEFT's lora.Linear adds per adapter and micro-step: the input cast, lora_A, lora_B, the scaling and the add in
# forward, and in backward the two input-gradient and two weight-gradient matmuls of its rank-r GEMMs, the scale's
# and the cast's backward (12 kernels), plus dropout and its backward (2) -- small kernels whose cost is their
# launch, not their FLOPs. Counted, not fitted: 143 kernels per full-fine-tuning Llama layer, 242 with 7 adapters
# and dropout, 228 without (python benchmarks/lora_ops.py; transformers 5.23, PEFT 0.21).
OPS_PER_LORA_ADAPTER = 12
OPS_PER_LORA_DROPOUT = 2
# Engine work per micro-step, per parameter tensor (Python hooks, flatten/copy kernels, stream syncs):
# DeepSpeed ZeRO-3 fetches and releases every parameter in forward and backward (stage3.py,
# partitioned_param_coordinator.py); ZeRO-1/2 copy every gradient into a bucket and upcast it
# (stage_1_and_2.py / bf16_optimizer.py hooks); FSDP2 runs a pre-forward / pre-backward /
# post-backward hook per wrapped unit. The magnitudes are the one engine-specific measurement here:
# H100 runs at world size 1 (no communication) of Llama-3.2-1B (147 parameter tensors) took
# +45 ms (ZeRO-2) and +190 ms (ZeRO-3) per micro-step over the Trainer's plain loop (../shared/gpu).
ZERO_HOOK_S = {3: 1.2e-3, 2: 300e-6, 1: 300e-6}  # by ZeRO stage
FSDP_UNIT_HOOK_S = 150e-6
TENSORS_PER_LAYER = 9  # q, k, v, o, gate, up, down, two norms
# Link bandwidths when the hardware does not say (GB/s per device, achieved bus bandwidth):
# NVLink-class nodes reach ~150 GB/s in NCCL all-reduce bus bandwidth; a 200 Gb/s NIC per GPU
# (InfiniBand / EFA) ~25 GB/s; PCIe 4.0 x16 host<->device ~25 GB/s.
DEFAULT_INTRA_GBPS = 150.0
DEFAULT_INTER_GBPS = 25.0
PCIE_GBPS = 25.0
# One PCIe 4.0 NVMe drive sustains ~3 GB/s of mixed reads and writes (7 GB/s sequential reads); pass the node's
# aggregate (``--nvme-gbps``) for a RAID of several.
DEFAULT_NVME_GBPS = 3.0
# Unknown devices: a mid-range GPU. A CPU rank's peak is measured (hardware.cpu_rank_peak_tflops, detect_hardware
# sets it); for a CPU Hardware described without it, one core at the documented 32 fp32 FLOPs per cycle (two 256-bit
# FMA pipes: AVX2 / AVX-512 on Zen 4) and 2.5 GHz. Either way the GPUs' GEMM_EFFICIENCY applies: eager training
# reaches about half of a core's dense peak too (docs/planner.md, "Throughput on CPU ranks").
DEFAULT_GPU_TFLOPS, DEFAULT_GPU_HBM_GBPS = 300.0, 2000.0
CPU_CORE_TFLOPS, CPU_MEMORY_GBPS = 0.08, 50.0
# DeepSpeedCPUAdam steps ~1e9 params/s per node (AVX-512, all cores); torch's AdamW on CPU ~4x slower.
CPU_ADAM_PARAMS_PER_S = 1e9
# ZeRO-Infinity per optimizer step, per node: the fp32 master weights and both moments are read and written back
# (24 bytes per param) and the fp32 gradients written (4): stage3.py swaps each sub-group in, steps, swaps it out.
NVME_BYTES_PER_PARAM_STEP = 28


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by cause, and the resulting tokens per second (all ranks)."""

    compute: float
    memory: float
    dispatch: float
    optimizer: float
    comm: float
    tokens: int

    @property
    def seconds(self) -> float:
        return self.compute + self.memory + self.dispatch + self.optimizer + self.comm

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def device_rates(hw: Hardware) -> tuple[float, float]:
    """(dense FLOP/s, memory bytes/s) of one device."""
    if hw.device == "cpu":
        return (hw.peak_tflops or CPU_CORE_TFLOPS) * 1e12, CPU_MEMORY_GBPS * 1e9
    tflops = hw.peak_tflops or peak_tflops_for(hw.gpu_name) or DEFAULT_GPU_TFLOPS
    gbps = hw.memory_gbps or memory_gbps_for(hw.gpu_name) or DEFAULT_GPU_HBM_GBPS
    return tflops * 1e12, gbps * 1e9


def comm_seconds(
    s: Strategy | str, offload, spec, trainable, world, nodes, accum, pb, gb, hw: Hardware, sync_each_batch=False
) -> float:
    """Per optimizer step, per rank, seconds spent moving bytes (ring collectives, bandwidth-bound).

    Ring all-reduce moves 2(N-1)/N of the buffer per rank, reduce-scatter and all-gather (N-1)/N each
    (Patarasuk & Yuan 2009; NCCL performance docs). DDP and ZeRO-1 reduce once per optimizer step
    (no_sync / local accumulation); ZeRO-2 reduce-scatters each micro-step; FSDP and ZeRO-3 gather
    parameters in forward and backward (FSDP2 shard-grad-op only in forward) every micro-step. ZeRO-3
    reduce-scatters gradients every micro-step; FSDP2 under the Trainer's ``no_sync``
    (``set_requires_gradient_sync(False)`` on all but the last micro-batch, accelerate ``Accelerator.no_sync``)
    once per optimizer step, and every micro-step with ``sync_each_batch``.
    """
    s = strategy(s)
    intra = (hw.intra_node_gbps or DEFAULT_INTRA_GBPS) * 1e9
    inter = (hw.inter_node_gbps or DEFAULT_INTER_GBPS) * 1e9
    link = inter if nodes > 1 else intra
    params, grads = spec.num_params * pb, trainable * gb
    reductions = gradient_reductions(s, accum, sync_each_batch)
    seconds = 0.0
    if world > 1 and s.replicates_across_nodes:
        g = world // nodes
        fi, fo = (g - 1) / g, (nodes - 1) / nodes
        seconds = fi * 2 * params / intra * accum + (fi * grads / intra + 2 * fo * grads / g / inter) * reductions
    elif world > 1:
        f = (world - 1) / world
        if s.shards.params:  # gathered for forward, and again for backward unless kept gathered
            seconds += (1 if s.gathers_params else 2) * f * params * accum / link
        elif s.shards.optimizer:  # updated shards gathered once after the step
            seconds += f * params / link
        if s.shards.grads:  # reduce-scattered every micro-step, or once per step (FSDP2's no_sync)
            seconds += f * grads * reductions / link
        else:  # reduced once per step: reduce-scatter (sharded optimizer) or all-reduce
            seconds += (1 if s.shards.optimizer else 2) * f * grads / link
    if offload != "none":
        # gradients to the host and updated parameters back, every optimizer step, over PCIe
        degree = s.shard_degree(world, nodes)
        seconds += (trainable * (gb + pb)) / degree / (PCIE_GBPS * 1e9)
        if offload == "optimizer+params":
            seconds += 2 * params / degree * accum / (PCIE_GBPS * 1e9)
    return seconds


def gradient_reductions(s: Strategy, accum: int, sync_each_batch: bool = False) -> int:
    """Gradient reductions per optimizer step of a gradient-sharding engine: DeepSpeed ZeRO-2/3 reduce every
    micro-step (the Trainer never runs DeepSpeed under ``no_sync``); FSDP2 once (accelerate's ``no_sync``), or every
    micro-step with ``sync_each_batch`` (transformers ``Trainer._inner_training_loop``)."""
    return accum if sync_each_batch or not s.is_fsdp else 1


def model_parallel_seconds(layout, spec, seq_len: int, micro_batch_size: int, hw: Hardware, ckpt: bool) -> float:
    """Per micro-step, seconds one rank spends in the activation collectives of tensor / context / sequence
    parallelism (not overlapped with compute: an upper bound). ``spec`` is the whole model, ``seq_len`` the whole
    sequence. Inside one node (accelerate's mesh puts tp, then cp/sp, innermost) they use the NVLink-class link.

    - TP (Megatron-style column/row pairs, Shoeybi et al. 2019): per layer two all-reduces of the ``[tokens, h]``
      activations in forward and two of their gradients in backward, plus the gather of ``lm_head``'s output;
    - CP (torch ring attention): per layer each rank receives the other ranks' K and V in forward, and K, V and
      their gradients in backward;
    - SP (DeepSpeed Ulysses, Jacobs et al. 2023): per layer all-to-alls of q, k, v and the attention output in
      forward and of their gradients in backward, each moving ``(sp-1)/sp`` of the tensor.
    Activation checkpointing runs each layer's forward, and its collectives, again.
    """
    if layout.tp_size * layout.seq_shards == 1 or not spec.has_shape:
        return 0.0
    group = layout.tp_size * layout.seq_shards
    link = (hw.intra_node_gbps or DEFAULT_INTRA_GBPS) if group <= layout.gpus_per_node else None
    link = (link or hw.inter_node_gbps or DEFAULT_INTER_GBPS) * 1e9
    c = 2  # activations travel in the compute dtype
    tokens = seq_len * micro_batch_size // layout.seq_shards
    h, kv, q = spec.hidden_size, spec.num_key_value_heads * spec.head_dim, spec.num_attention_heads * spec.head_dim
    passes = 3 if ckpt else 2  # forward (+ recompute) and backward
    per_layer = 0.0
    tp, cp, sp = layout.tp_size, layout.cp_size, layout.sp_size
    if tp > 1:
        per_layer += passes * 2 * 2 * (tp - 1) / tp * tokens * h * c
    if cp > 1:
        per_layer += (passes + 1) * (cp - 1) * tokens * 2 * kv // tp * c
    if sp > 1:
        per_layer += passes * (sp - 1) / sp * tokens * (2 * q + 2 * kv) // tp * c
    head = (tp - 1) / tp * tokens * spec.vocab_size * c if tp > 1 else 0.0
    return (per_layer * spec.num_layers + head) / link


def nvme_seconds(spec, trainable: int, offload: str, accum: int, pb: int, hw: Hardware) -> float:
    """Per optimizer step, seconds the node's NVMe drives spend swapping ZeRO-Infinity's states (``hw.nvme_gbps``:
    the node's aggregate bandwidth): the optimizer's sub-groups every step, and with the parameters on NVMe each
    rank's partition read for forward and again for backward on every micro-step."""
    per_node = trainable * NVME_BYTES_PER_PARAM_STEP / hw.nodes
    if offload == "optimizer+params":
        per_node += 2 * spec.num_params * pb * accum / hw.nodes
    return per_node / ((hw.nvme_gbps or DEFAULT_NVME_GBPS) * 1e9)


def _engine_hooks_s(s: Strategy, spec) -> float:
    layers = max(spec.num_layers, 1)
    if s.is_deepspeed:
        return ZERO_HOOK_S[s.zero_stage] * (layers * TENSORS_PER_LAYER + 3)
    if s.is_fsdp:
        return FSDP_UNIT_HOOK_S * 3 * (layers + 1)
    return 0.0


def flash_efficiency(hw: Hardware) -> float:
    """The fraction of the dense peak flash attention reaches on ``hw`` (:data:`FLASH_EFFICIENCY_HOPPER`); on a CPU
    rank the GEMMs' (its sdpa kernel is a blocked matmul like any other)."""
    if hw.device == "cpu":
        return GEMM_EFFICIENCY
    name = hw.gpu_name or ""
    return FLASH_EFFICIENCY_HOPPER if any(h in name for h in HOPPER) else FLASH_EFFICIENCY_OTHER


def compute_seconds_per_token(spec, trainable: int, seq_len: int, ckpt: bool, hw: Hardware) -> float:
    """Seconds of matrix work one token costs one rank: the linear layers at :data:`GEMM_EFFICIENCY` and the
    attention matmuls at the flash kernels' efficiency (:func:`flash_efficiency`; eager attention's batched matmuls at
    the GEMMs'), each counted as the step runs them (:func:`~hf_dist.planning.flops.matmul_flops_per_token`,
    :func:`~hf_dist.planning.flops.attention_flops_per_token`): a frozen base computes no weight gradients, and
    checkpointing recomputes every decoder layer's forward -- the whole of it, frozen or not, and not the LM head.
    A LoRA model's ``trainable`` are its adapters, which run on top of the base's linears."""
    flops_s = device_rates(hw)[0]
    if not spec.has_shape:  # a bare parameter count: 6 FLOPs per parameter per token
        return 6 * spec.num_params / (flops_s * GEMM_EFFICIENCY)
    base = spec.num_params - (spec.embedding_params if spec.lm_head_params else 0)  # the embedding is a lookup
    adapters = trainable if trainable < spec.num_params else 0
    layers = spec.layer_params * spec.num_layers + adapters
    matmul = matmul_flops_per_token(
        matmul_params=base + adapters, trainable_matmul_params=adapters or base,
        recomputed_matmul_params=layers if ckpt else 0,
    )  # fmt: skip
    flash = spec.attention != "eager"
    attention = attention_flops_per_token(
        num_layers=spec.num_layers, query_width=(spec.num_attention_heads * spec.head_dim) or spec.hidden_size,
        keys=seq_len, flash=flash, recomputed=ckpt,
    )  # fmt: skip
    attention_efficiency = flash_efficiency(hw) if flash else GEMM_EFFICIENCY
    return matmul / (flops_s * GEMM_EFFICIENCY) + attention / (flops_s * attention_efficiency)


def optimizer_step_bytes(param_bytes: int, grad_bytes: int, state_bytes: int) -> int:
    """Device memory traffic of one optimizer step on a rank's states (``_bytes``: what the rank holds of each).

    The Trainer's ``adamw_torch_fused`` is one kernel per parameter group that reads the weights, the gradients and
    both moments and writes the weights and the moments back (torch ``_fused_adamw_``); before it, the Trainer clips
    the gradients to ``max_grad_norm`` (1.0 by default): ``clip_grad_norm_`` reads every gradient for the norm and
    scales it in place (``_foreach_norm``, ``_foreach_mul_``: one read, one read and one write)."""
    adam = 2 * param_bytes + grad_bytes + 2 * state_bytes
    clipping = 3 * grad_bytes
    return adam + clipping


def step_time(
    spec, hw: Hardware, memory, *, strategy: Strategy, offload: str, trainable: int, micro_batch_size: int,
    accumulation: int, seq_len: int, activation_checkpointing: bool, use_liger_kernel: bool, comm: float,
    dp_size: int | None = None, seq_shards: int = 1, tp_size: int = 1, lora_adapters: float = 0,
    lora_dropout: bool = False,
) -> StepTime:  # fmt: skip
    """Estimated seconds per optimizer step on each rank, from ``memory`` (a MemoryEstimate of the same layout).

    Under model parallelism ``spec`` and ``trainable`` are one tensor-parallel rank's share
    (``ModelSpec.tensor_parallel_shard``), each rank computes ``seq_len / seq_shards`` tokens of a sequence
    against all ``seq_len`` keys, and only the ``dp_size`` data-parallel groups see different sequences;
    ``comm`` then includes :func:`model_parallel_seconds` for every micro-step. LoRA (``lora_adapters`` per layer):
    the frozen base still computes its input gradients (4 of 6 FLOPs per frozen parameter), the saved activations
    include the adapters' dropout copies (``memory``), and every adapter adds its small kernels' dispatch."""
    flops_s, bytes_s = device_rates(hw)
    dp_size = hw.world_size if dp_size is None else dp_size
    tokens = seq_len * micro_batch_size // seq_shards
    compute = tokens * compute_seconds_per_token(spec, trainable, seq_len, activation_checkpointing, hw)
    saved = memory.activations + memory.logits
    traffic = saved * TRAFFIC_PER_SAVED_BYTE * (1.25 if activation_checkpointing else 1.0)
    per_layer = OPS_PER_LAYER_LIGER if use_liger_kernel else OPS_PER_LAYER
    per_layer += lora_adapters * (OPS_PER_LORA_ADAPTER + (OPS_PER_LORA_DROPOUT if lora_dropout else 0))
    ops = per_layer * max(spec.num_layers, 1) * (1 + (RECOMPUTED_OPS_FRACTION if activation_checkpointing else 0))
    dispatch = ops * DISPATCH_S + _engine_hooks_s(strategy, spec)
    if offload == "none":
        optimizer = optimizer_step_bytes(memory.params, memory.grads, memory.optimizer) / bytes_s
    else:
        # each node's CPUs step the node's share of all trainable parameters (every TP rank's slice)
        optimizer = trainable * tp_size / hw.nodes / CPU_ADAM_PARAMS_PER_S
    per_micro = accumulation
    return StepTime(compute * per_micro, traffic / bytes_s * per_micro, dispatch * per_micro, optimizer, comm,
                    seq_len * micro_batch_size * accumulation * dp_size)  # fmt: skip
