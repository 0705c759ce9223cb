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
    Lora,
    activation_bytes,
    largest_transient_bytes,
    layer_gradient_bytes,
    logits_bytes,
    trl_head_bytes,
)
from hf_dist.planning.dtypes import FP32, GIB, Dtypes, engine_dtypes
from hf_dist.planning.layout import Layout, Strategy
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
from hf_dist.planning.transients import (
    allocator_bytes,
    buffer_bytes,
    overhead_bytes,
    step_bytes_per_rank,
    zero3_gathered_bytes,
)
from hf_dist.validation import check_choice, check_positive_int

METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
ATTENTIONS = ("sdpa", "flash_attention_2", "eager")
DEVICES = ("cuda", "cpu")
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
    released_at_step: int = 0  # part of ``buffers`` freed before the optimizer step (ZeRO-3's gathered parameters)
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
            transient = max(forward_backward, end_of_backward, self.grads + self.step - self.released_at_step)
        else:
            transient = max(forward_backward + self.grads, self.grads + self.step - self.released_at_step)
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


# ---------------------------------------------------------------- public entry point


def estimate_memory(
    model_or_num_params: Any, strategy: str, world_size: int, *, nodes: int = 1, method: str = "full",
    offload: str = "none", optimizer: str = "adamw", master_weights: bool = True, param_bytes: int = 2,
    grad_bytes: int | None = None, seq_len: int = 2048, micro_batch_size: int = 1, activation_checkpointing: bool = False,
    lora_rank: int = 16, overhead: int | None = None, gradient_accumulation_steps: int = 1,
    use_liger_kernel: bool = False, attention: str | None = None, device: str = "cuda", base_bytes: int | None = None,
    tp_size: int = 1, cp_size: int = 1, sp_size: int = 1, offload_device: str = "cpu",
    lora_dropout: float = LORA_DROPOUT, checkpoint_children: bool = False, fsdp2_embedding_unit: bool = True,
    fused_lm_head: bool = False, trust_remote_code: bool = False,
) -> MemoryEstimate:  # fmt: skip
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
    (:func:`~hf_dist.planning.activations.trl_head_bytes`). ``trust_remote_code=True`` lets a folder's ``auto_map``
    classes be imported; without it they never are (:mod:`hf_dist.planning.remote_code`).
    """
    from hf_dist.planning.modelinfo import model_spec

    run = Layout(
        strategy, world_size, nodes, offload, activation_checkpointing,
        tp_size=tp_size, cp_size=cp_size, sp_size=sp_size, offload_device=offload_device,
    )  # fmt: skip
    validate_args(run, method, optimizer, param_bytes, grad_bytes, lora_rank)
    for name, value in (("seq_len", seq_len), ("micro_batch_size", micro_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):  # fmt: skip
        check_positive_int(name, value)
    check_choice("device", device, DEVICES)
    spec = model_spec(model_or_num_params, trust_remote_code=trust_remote_code)
    attention = spec.attention if attention is None else attention
    check_choice("attention", attention, ATTENTIONS)
    run.check_model(spec, seq_len)
    base_bytes = _base_bytes(param_bytes, base_bytes)
    lay = engine_dtypes(run.strategy, param_bytes, master_weights, method, base_bytes)
    r = _Run(
        run, spec, run.rank_spec(spec), replace(lay, grads=grad_bytes) if grad_bytes is not None else lay,
        method, offload, optimizer, param_bytes, base_bytes, seq_len // run.seq_shards, seq_len, micro_batch_size,
        gradient_accumulation_steps, lora_rank, lora_dropout, use_liger_kernel, attention, device,
        checkpoint_children, fsdp2_embedding_unit, fused_lm_head,
    )  # fmt: skip
    return _estimate(r, overhead)


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
    lora_rank: int
    lora_dropout: float
    liger: bool
    attention: str
    device: str
    checkpoint_children: bool
    embedding_unit: bool
    fused_lm_head: bool

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
        return trainable_params(self.spec, self.method, self.lora_rank)


def _estimate(r: _Run, overhead: int | None) -> MemoryEstimate:
    params, grads, optim, padded_unit = _model_states(r)
    acts, recompute = activation_bytes(r.spec, r.seq_len, r.mb, r.ckpt, r.lay, **_activation_kwargs(r))
    last_layer = recompute if r.ckpt else (acts // r.spec.num_layers if r.spec.num_layers else 0)
    buffers, units = buffer_bytes(
        r.spec, r.s, r.layout.world_size // r.layout.tp_size, r.trainable, r.lay, r.ckpt, padded_unit,
        embedding_unit=r.embedding_unit,
    )  # fmt: skip
    nvme = r.layout.offload_device == "nvme"
    states = (r.spec, r.degree, r.trainable, r.method, r.offload, r.optimizer, r.lay, r.param_bytes)
    on_gpu = r.device == "cuda"
    allocator = 0
    if on_gpu:
        largest = largest_transient_bytes(r.spec, r.seq_len, r.mb, r.lay, r.liger, r.fused_lm_head)
        allocator = allocator_bytes(r.spec, r.s, r.degree, r.trainable, r.lay, largest, grads, r.ckpt)
    fixed = int(overhead) if overhead is not None else (overhead_bytes(r.s, r.layout.world_size) if on_gpu else 0)
    layer_grads = layer_gradient_bytes(r.spec, r.seq_len, r.mb, r.lay, liger=r.liger) if r.spec.has_shape else 0
    return MemoryEstimate(
        params, grads, optim, acts, buffers, fixed,
        cpu_bytes_per_rank(*states, nvme, r.device),
        not grads_persist(r.s, r.lay, r.accumulation),
        _head_bytes(r),
        step_bytes_per_rank(r.spec, r.s, r.degree, r.trainable, r.offload, r.lay),
        allocator, recompute, units, last_layer, layer_grads,
        zero3_gathered_bytes(r.spec, r.s, r.layout.world_size // r.layout.tp_size, r.lay),
        swap_bytes_per_rank(*states, r.device) if nvme else 0,
    )  # fmt: skip


def _model_states(r: _Run) -> tuple[int, int, int, int]:
    """(params, grads, optimizer state, FSDP2's padded elements per gathered decoder layer) of one rank."""
    s, spec, lay, degree, trainable = r.s, r.spec, r.lay, r.degree, r.trainable
    params = param_bytes_per_rank(spec, s, degree, r.method, r.offload, lay, r.base_bytes, r.lora_rank)
    grads = grad_bytes_per_rank(s, degree, trainable, r.offload, lay, r.accumulation)
    padded, padded_unit = fsdp_row_padding(spec, degree) if s.is_fsdp and r.offload == "none" else (0, 0)
    if r.layout.tp_size > 1 and r.method == "full" and not s.shards.grads:
        # the vocabulary-parallel embedding (embedding_rowwise) gets a replicated, full-vocabulary gradient
        # (DTensor Replicate, measured on 2 TP ranks), not its shard
        grads += (r.whole.embedding_params - spec.embedding_params) * lay.grads
    optim = optimizer_bytes_per_rank(s, degree, trainable, r.offload, r.optimizer, lay)
    if padded:  # every sharded state of the padded rows; the routed experts are trainable only in full fine-tuning
        full = r.method == "full"
        params += padded * (lay.weights if full else r.base_bytes)
        grads += padded * lay.grads if full and s.shards.grads and r.accumulation == 1 else 0
        optim += padded * (optimizer_state_bytes(r.optimizer, lay.state) + lay.master) if full else 0
    return params, grads, optim, padded_unit


def _activation_kwargs(r: _Run) -> dict[str, Any]:
    act_kw: dict[str, Any] = {"attention": r.attention, "liger": r.liger, "keys": r.keys}
    if r.checkpoint_children and r.s.is_fsdp:  # accelerate <= 1.14 (LibraryFeatures.fsdp2_checkpoints_children)
        act_kw["checkpoint_children"] = True
    if r.method != "full":  # fp32 adapters under DDP's autocast: each casts its input to fp32 and back (a copy each)
        cast = r.s.is_ddp and r.lay.weights == FP32 and r.lay.compute < FP32
        act_kw["lora"] = Lora(r.lora_rank, dropout=r.lora_dropout > 0, cast=cast)
    return act_kw


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
    over 64 ranks: 8x their share). Found by tracing Mixtral 8x7B on 64 ranks.
    """
    if not spec.experts or degree <= spec.experts and spec.experts % degree == 0:
        return 0, 0
    per_layer = 3 * spec.hidden_size * spec.intermediate_size  # one expert: gate, up, down
    rows = math.ceil(spec.experts / degree)
    per_rank = spec.num_layers * rows * per_layer - math.ceil(spec.num_layers * spec.experts * per_layer / degree)
    return max(per_rank, 0), (rows * degree - spec.experts) * per_layer
