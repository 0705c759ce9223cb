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
- **Allocator**: what torch's caching allocator reserves beyond the peak allocated: the compute stream's free blocks
  (:func:`~hf_dist.planning.transients.compute_stream_reserve_bytes`, an estimate; a trace replays the allocations
  through :mod:`hf_dist.planning.allocator` instead) and the collectives' streams' (``comm_reserve``).
- **Overhead**: the CUDA context, library workspaces and NCCL communicators, outside torch's allocator.

``MemoryEstimate.total`` predicts the device memory in use at the peak (``total - free`` from
``cudaMemGetInfo``), ``allocated`` predicts ``torch.cuda.max_memory_allocated`` and ``reserved``
``max_memory_reserved``. Checked against an H100 in ``benchmarks/gpu_ground_truth.py`` and against
tensors allocated on CPU ranks in ``benchmarks/planner_accuracy.py`` (docs/measurements.md).

Units: every function returns bytes (``_bytes`` in its name) for ONE rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from hf_dist.planning.activations import (
    Lora,
    activation_bytes,
    layer_gradient_bytes,
    lora_bytes,
    zero3_leaf_gradient_bytes,
)
from hf_dist.planning.dtypes import FP32, Dtypes, engine_dtypes
from hf_dist.planning.head_activations import largest_transient_bytes, logits_bytes, trl_head_bytes
from hf_dist.planning.layout import Layout, Strategy
from hf_dist.planning.lora import LoraSpec
from hf_dist.planning.lora_plan import Placement, place, resolve
from hf_dist.planning.memory_estimate import MemoryEstimate
from hf_dist.planning.model_states import (
    cpu_bytes_per_rank,
    grad_bytes_per_rank,
    grads_persist,
    optimizer_bytes_per_rank,
    optimizer_state_bytes,
    param_bytes_per_rank,
    swap_bytes_per_rank,
    trainable_params,
)
from hf_dist.planning.moe import zero3_leaf_block_params
from hf_dist.planning.transients import (
    buffer_bytes,
    comm_stream_reserve_bytes,
    compute_stream_reserve_bytes,
    lora_input_cast_bytes,
    overhead_bytes,
    step_bytes_per_rank,
    zero3_gathered_bytes,
)
from hf_dist.validation import check_choice, check_positive_int

METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
ATTENTIONS = ("sdpa", "flash_attention_2", "eager")
DEVICES = ("cuda", "cpu")


# ---------------------------------------------------------------- validation


def validate_args(layout: Layout, method, optimizer, param_bytes, grad_bytes) -> None:
    """Raise ValueError naming the bad argument, the allowed values and the fix (the layout checked itself)."""
    check_choice("method", method, METHODS)
    check_choice("optimizer", optimizer, OPTIMIZERS)
    if method == "qlora" and layout.offload != "none":
        raise ValueError(f"qlora keeps 4-bit base weights on the GPU; offload must be 'none', got {layout.offload!r}")
    if param_bytes not in (2, 4):
        raise ValueError(
            f"param_bytes must be 2 (bf16/fp16 compute) or 4 (fp32), got {param_bytes!r}; "
            "the memory model knows float32, bfloat16 and float16"
        )
    if grad_bytes not in (None, 2, 4):
        raise ValueError(f"grad_bytes must be 2, 4 or None (what the strategy keeps), got {grad_bytes!r}")


# ---------------------------------------------------------------- public entry point


def estimate_memory(
    model_or_num_params: Any, strategy: str, world_size: int, *, nodes: int = 1, method: str | None = None,
    offload: str = "none", optimizer: str = "adamw", master_weights: bool = True, param_bytes: int = 2,
    grad_bytes: int | None = None, seq_len: int = 2048, micro_batch_size: int = 1, activation_checkpointing: bool = False,
    lora_rank: int | None = None, overhead: int | None = None, gradient_accumulation_steps: int = 1,
    use_liger_kernel: bool = False, attention: str | None = None, device: str = "cuda", base_bytes: int | None = None,
    tp_size: int = 1, cp_size: int = 1, sp_size: int = 1, offload_device: str = "cpu",
    lora_dropout: float | None = None, lora_targets: Any = None, peft_config: Any = None,
    lora: LoraSpec | Placement | None = None, checkpoint_children: bool = False, fsdp2_embedding_unit: bool = True,
    fused_lm_head: bool = False, sync_each_batch: bool = False, trust_remote_code: bool = False,
) -> MemoryEstimate:  # fmt: skip
    """Per-rank memory of training ``model_or_num_params`` with ``strategy`` on ``world_size`` ranks.

    ``model_or_num_params``: a parameter count (activations are then 0), a ModelSpec, a config, a model, a local
    folder / config.json or a hub name. ``param_bytes``: the compute dtype's size; ``master_weights``: fp32 master
    weights and optimizer state (``param_bytes=2, master_weights=False`` is pure bf16, :func:`engine_dtypes`);
    ``grad_bytes`` overrides the gradient dtype. ``attention``: the ``attn_implementation`` (default: the model's
    own). ``device="cpu"``: no CUDA context or caching allocator. ``base_bytes``: a LoRA model's frozen base as loaded
    (default: the compute dtype's). ``overhead`` overrides the context term. Accumulation keeps gradients alive next
    to activations (:class:`MemoryEstimate`).

    LoRA (:mod:`hf_dist.planning.lora`): a ``PeftModel``'s own config, or ``peft_config`` (a PEFT ``LoraConfig``)
    before the model exists, or the ``lora_rank`` / ``lora_dropout`` / ``lora_targets`` keywords over the recipes'
    LoRA (rank 16, dropout 0.05, every linear of the block); ``lora`` takes a ready :class:`LoraSpec` or
    :class:`Placement`. ``method`` (None) is ``lora`` when any of them is given, else ``full``.
    ``sync_each_batch``: FSDP2 reduce-scatters every micro-batch instead of keeping unsharded gradients until the last.

    Model parallelism (:class:`~hf_dist.planning.layout.Layout` checks the sizes): ``tp_size`` splits the linear
    weights, their states and the head / MLP activations; ``cp_size`` / ``sp_size`` split each sequence and widen the
    group the states are sharded over. ``offload_device="nvme"`` keeps offloaded states in swap files
    (:func:`cpu_bytes_per_rank`). ``checkpoint_children`` / ``fsdp2_embedding_unit``: how the installed accelerate
    wraps FSDP2 units. ``fused_lm_head``: TRL's fused LM head. ``trust_remote_code``: :mod:`~.remote_code`.
    """
    from hf_dist.planning.modelinfo import model_spec

    run = Layout(
        strategy, world_size, nodes, offload, activation_checkpointing,
        tp_size=tp_size, cp_size=cp_size, sp_size=sp_size, offload_device=offload_device,
        sync_each_batch=sync_each_batch,
    )  # fmt: skip
    if lora is None:
        lora_keywords = dict(lora_rank=lora_rank, lora_dropout=lora_dropout, lora_targets=lora_targets)
        method, lora = resolve(model_or_num_params, method, peft_config, **lora_keywords)
    method = method or ("full" if lora is None else "lora")
    validate_args(run, method, optimizer, param_bytes, grad_bytes)
    _check_shape(seq_len, micro_batch_size, gradient_accumulation_steps, device)
    spec = model_spec(model_or_num_params, trust_remote_code=trust_remote_code)
    placement = _placement(spec, method, lora)
    attention = spec.attention if attention is None else attention
    check_choice("attention", attention, ATTENTIONS)
    run.check_model(spec, seq_len)
    base_bytes = _base_bytes(param_bytes, base_bytes)
    lay = engine_dtypes(run.strategy, param_bytes, master_weights, method, base_bytes)
    r = _Run(
        run, spec, run.rank_spec(spec), replace(lay, grads=grad_bytes) if grad_bytes is not None else lay,
        method, offload, optimizer, param_bytes, base_bytes, seq_len // run.seq_shards, seq_len, micro_batch_size,
        gradient_accumulation_steps, placement, use_liger_kernel, attention, device,
        checkpoint_children, fsdp2_embedding_unit, fused_lm_head, run.sync_each_batch,
    )  # fmt: skip
    return _estimate(r, overhead)


def _check_shape(seq_len: int, micro_batch_size: int, gradient_accumulation_steps: int, device: str) -> None:
    for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):  # fmt: skip
        check_positive_int(name, value)
    check_choice("device", device, DEVICES)


def _placement(spec, method: str, lora: LoraSpec | Placement | None) -> Placement | None:
    """Where the LoRA of a ``lora``/``qlora`` run puts its adapters in ``spec`` (None for full fine-tuning)."""
    if method == "full":
        if lora is not None:
            raise ValueError("method='full' trains every weight; a LoRA spec was given too: pass method='lora'")
        return None
    return lora if isinstance(lora, Placement) else place(spec, lora or LoraSpec())


def _base_bytes(param_bytes: int, base_bytes: int | None) -> int:
    """A LoRA/QLoRA model's frozen base as loaded: the compute dtype's bytes unless given."""
    base_bytes = param_bytes if base_bytes is None else base_bytes
    if base_bytes not in (2, 4):
        raise ValueError(f"base_bytes must be 2 (bf16/fp16 weights) or 4 (fp32), got {base_bytes!r}")
    return base_bytes


@dataclass(frozen=True)
class _Run:
    """One :func:`estimate_memory` call's checked inputs: ``whole`` is the model, ``spec`` what one rank of a
    tensor-parallel group holds, ``seq_len`` a rank's share of each sequence of ``keys`` tokens."""

    layout: Layout
    whole: Any
    spec: Any
    lay: Dtypes
    method: str
    offload: str
    optimizer: str
    param_bytes: int
    base_bytes: int
    seq_len: int
    keys: int
    mb: int
    accumulation: int
    lora: Placement | None
    liger: bool
    attention: str
    device: str
    checkpoint_children: bool
    embedding_unit: bool
    fused_lm_head: bool
    sync_each_batch: bool

    @property
    def s(self) -> Strategy:
        return self.layout.strategy

    @property
    def ckpt(self) -> bool:
        return self.layout.activation_checkpointing

    @property
    def degree(self) -> int:
        return self.layout.state_shard_size

    @property
    def trainable(self) -> int:
        return trainable_params(self.spec, self.method, self.lora)


def _estimate(r: _Run, overhead: int | None) -> MemoryEstimate:
    params, grads, optim, padded_unit = _model_states(r)
    acts, recompute = activation_bytes(r.spec, r.seq_len, r.mb, r.ckpt, r.lay, **_activation_kwargs(r))
    acts += outer_adapter_bytes(r)
    last_layer = recompute if r.ckpt else (acts // r.spec.num_layers if r.spec.num_layers else 0)
    buffers, units = buffer_bytes(
        r.spec, r.s, r.layout.world_size // r.layout.tp_size, r.trainable, r.lay, r.ckpt, padded_unit,
        embedding_unit=r.embedding_unit,
    )  # fmt: skip
    nvme = r.layout.offload_device == "nvme"
    states = (r.spec, r.degree, r.trainable, r.method, r.offload, r.optimizer, r.lay, r.param_bytes)
    on_gpu = r.device == "cuda"
    allocator = comm_reserve = 0
    if on_gpu:
        largest = max(
            largest_transient_bytes(r.spec, r.seq_len, r.mb, r.lay, r.liger, r.fused_lm_head),
            lora_input_cast_bytes(r.seq_len * r.mb, _adapter_inputs(r), _adapters_cast(r)),
        )
        comm_reserve = comm_stream_reserve_bytes(r.spec, r.s, r.degree, r.trainable, r.lay)
        allocator = compute_stream_reserve_bytes(largest, grads, r.ckpt) + comm_reserve
    fixed = int(overhead) if overhead is not None else (overhead_bytes(r.s, r.layout.world_size) if on_gpu else 0)
    frozen = r.method != "full"
    layer_grads = (
        layer_gradient_bytes(r.spec, r.seq_len, r.mb, r.lay, liger=r.liger, frozen=frozen) if r.spec.has_shape else 0
    )
    if r.s.is_deepspeed and r.s.shards.params and not frozen and zero3_leaf_block_params(r.spec):
        # ZeRO-3 reduces a leaf MoE block's gradients only after its whole backward
        layer_grads = max(layer_grads, zero3_leaf_gradient_bytes(r.spec, r.seq_len, r.mb, r.lay))
    forward_gather = forward_gather_bytes(r, acts - recompute - (0 if r.ckpt else last_layer), padded_unit)
    return MemoryEstimate(
        params=params, grads=grads, optimizer=optim, activations=acts, buffers=buffers, overhead=fixed,
        cpu=cpu_bytes_per_rank(*states, nvme, r.device),
        grads_overlap_activations=not grads_persist(r.s, r.lay, r.accumulation),
        logits=_head_bytes(r),
        step=step_bytes_per_rank(r.spec, r.s, r.degree, r.trainable, r.offload, r.lay),
        allocator=allocator, recompute=recompute, unit_buffers=units, last_layer=last_layer, layer_grads=layer_grads,
        forward_gather=forward_gather,
        released_at_step=zero3_gathered_bytes(r.spec, r.s, r.layout.world_size // r.layout.tp_size, r.lay, r.ckpt),
        swap=swap_bytes_per_rank(*states, r.device) if nvme else 0, comm_reserve=comm_reserve,
    )  # fmt: skip


def forward_gather_bytes(r: _Run, earlier_activations: int, padded_unit: int) -> int:
    """FSDP2 in forward, at the last decoder layer's all-gather copy-out: ``earlier_activations`` (every layer's but
    the last one's) next to three gathered layers. With implicit prefetching (torch ``_fsdp_param_group.py
    FSDPParamGroup.wait_for_unshard``) the previous layer's all-gather output is dropped from
    ``comm_ctx.all_gather_state`` before this layer's copy-out, but the local ``prev_all_gather_state`` holds it until
    the function returns, so the copy-out into this layer's unsharded parameters runs next to both all-gather
    outputs. A gathered layer is its parameters in the compute dtype, FSDP2's padded expert rows
    (:func:`fsdp_row_padding`) and its LoRA adapters included. Found by tracing LoRA under FSDP2, whose peak this is
    where no loss logits outweigh it: Mixtral 8x7B on 64 ranks gathers three 21 GiB padded layers."""
    s = r.s
    resharded = s.is_fsdp and s.shards.params and not s.gathers_params and r.offload == "none"
    if not resharded or r.degree == 1 or r.layout.tp_size > 1 or not r.spec.has_shape:
        return 0
    last = r.lora.layers[-1] if r.lora is not None and r.lora.layers else ()
    adapters = sum(a.rank * (a.in_features + a.out_features) for a in last)
    return earlier_activations + 3 * (r.spec.layer_params + padded_unit + adapters) * r.lay.compute


def _model_states(r: _Run) -> tuple[int, int, int, int]:
    """(params, grads, optimizer state, FSDP2's padded elements per gathered decoder layer) of one rank."""
    s, spec, lay, degree, trainable = r.s, r.spec, r.lay, r.degree, r.trainable
    params = param_bytes_per_rank(spec, s, degree, r.method, r.offload, lay, r.base_bytes, r.lora)
    grads = grad_bytes_per_rank(s, degree, trainable, r.offload, lay, r.accumulation, r.sync_each_batch)
    padded, padded_unit = fsdp_row_padding(spec, degree) if s.is_fsdp and r.offload == "none" else (0, 0)
    if r.layout.tp_size > 1 and r.method == "full" and not s.shards.grads:
        # the vocabulary-parallel embedding (embedding_rowwise) gets a replicated, full-vocabulary gradient
        # (DTensor Replicate, measured on 2 TP ranks), not its shard
        grads += (r.whole.embedding_params - spec.embedding_params) * lay.grads
    optim = optimizer_bytes_per_rank(s, degree, trainable, r.offload, r.optimizer, lay)
    if padded:  # every sharded state of the padded rows; the routed experts are trainable only in full fine-tuning
        full = r.method == "full"
        params += padded * (lay.weights if full else r.base_bytes)
        reduced = r.accumulation == 1 or r.sync_each_batch  # the padded rows of sharded gradients
        grads += padded * lay.grads if full and s.shards.grads and reduced else 0
        optim += padded * (optimizer_state_bytes(r.optimizer, lay.state) + lay.master) if full else 0
    return params, grads, optim, padded_unit


def _activation_kwargs(r: _Run) -> dict[str, Any]:
    act_kw: dict[str, Any] = {"attention": r.attention, "liger": r.liger, "keys": r.keys}
    if r.checkpoint_children and r.s.is_fsdp:  # accelerate <= 1.14 (LibraryFeatures.fsdp2_checkpoints_children)
        act_kw["checkpoint_children"] = True
    if r.lora is not None:
        act_kw["lora_layers"] = lora_layers(r)
        act_kw["idle_layers"] = r.lora.idle_layers if _inputs_frozen(r) else 0
        # ZeRO-3's linear saves the frozen base linears' inputs (activations.zero3_frozen_linear_bytes); QLoRA's 4-bit
        # base runs bitsandbytes' matmul instead
        act_kw["zero3_linear"] = r.s.is_deepspeed and r.s.shards.params and r.method == "lora"
    return act_kw


def _adapters_cast(r: _Run) -> bool:
    """fp32 adapters under DDP's autocast: PEFT casts every adapter's 16-bit input to fp32 (a copy)."""
    return r.lora is not None and r.s.is_ddp and r.lay.weights == FP32 and r.lay.compute < FP32


def _adapter_inputs(r: _Run) -> tuple[int, ...]:
    return tuple(a.in_features for a in r.lora.adapters) if r.lora is not None else ()


def lora_layers(r: _Run) -> tuple[Lora, ...]:
    """Each decoder layer's adapters as :class:`~hf_dist.planning.activations.Lora`: fp32 adapters under DDP's
    autocast cast their input to fp32 and back (a copy each)."""
    cast = _adapters_cast(r)
    dropout = r.lora.lora.dropout > 0
    first = r.lora.idle_layers if _inputs_frozen(r) else -1  # the first layer that trains sees no input gradient
    return tuple(
        Lora(tuple((a.name, a.in_features, a.rank) for a in layer), dropout, cast, input_grad=i != first)
        for i, layer in enumerate(r.lora.layers)
    )


def _inputs_frozen(r: _Run) -> bool:
    """Whether the decoder layers' input needs no gradient: nothing before them trains, and no one made the
    embedding's output require one -- transformers' checkpointing (DDP, DeepSpeed: the Trainer's flag) calls
    ``enable_input_require_grads``, as PEFT's k-bit preparation does for QLoRA."""
    transformers_ckpt = r.ckpt and not r.s.is_fsdp
    return r.lora.frozen_inputs and not transformers_ckpt and r.method != "qlora"


def outer_adapter_bytes(r: _Run) -> int:
    """What the adapters outside the decoder layers save (LoRA on ``lm_head``), for the step's tokens."""
    if r.lora is None or not r.lora.outer:
        return 0
    cast = _adapters_cast(r)
    adapters = tuple((a.name, a.in_features, a.rank) for a in r.lora.outer)
    return lora_bytes(r.lay, Lora(adapters, r.lora.lora.dropout > 0, cast), attention=r.attention) * r.seq_len * r.mb


def _head_bytes(r: _Run) -> int:
    """The LM head and the loss: the logits, or TRL's fused head, which never holds them."""
    if not r.spec.has_shape:
        return 0
    if r.fused_lm_head:
        gathered = r.lay.compute if r.s.is_fsdp else r.lay.weights  # FSDP2 gathers the head in its param dtype
        return trl_head_bytes(
            r.spec, r.seq_len * r.mb, r.lay, trains_head=r.method == "full", weight_bytes=gathered, liger=r.liger
        )
    return logits_bytes(r.spec, r.seq_len, r.mb, r.lay, liger=r.liger)


def fsdp_row_padding(spec, degree: int) -> tuple[int, int]:
    """Elements FSDP2's dim-0 sharding adds: ``(per rank, per gathered decoder layer)``.

    ``fully_shard`` splits every parameter into ``degree`` chunks along dim 0 (``torch.chunk``) and pads each rank's
    shard to ``ceil(rows / degree)`` rows (torch ``_fsdp_param.py``), and the all-gather returns the padded whole.
    Dense weights have thousands of rows, so only transformers' stacked routed experts, ``(experts, out, in)``
    tensors, are padded measurably: with more ranks than experts every rank holds a whole expert's rows (8 experts
    over 64 ranks: 8x their share). Found by tracing Mixtral 8x7B on 64 ranks. Only MoE layers hold stacked experts
    (DeepSeek's first ``first_k_dense_replace`` layers are dense).
    """
    if not spec.experts or degree <= spec.experts and spec.experts % degree == 0:
        return 0, 0
    per_layer = 3 * spec.hidden_size * spec.intermediate_size  # one expert: gate, up, down
    rows = math.ceil(spec.experts / degree)
    layers = spec.num_layers - (spec.moe.dense_layers if spec.moe else 0)
    per_rank = layers * rows * per_layer - math.ceil(layers * spec.experts * per_layer / degree)
    return max(per_rank, 0), (rows * degree - spec.experts) * per_layer
