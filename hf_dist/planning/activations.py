"""What a decoder layer saves for backward, per rank (the LM head and the loss: :mod:`hf_dist.planning.head_activations`):
pure arithmetic, bytes.

Each term follows what the HF implementation saves, tensor by tensor (transformers' modeling_llama.py and
friends; PEFT's ``lora.Linear``; transformers' ``integrations/moe.py``), and was checked against the tracer
(:mod:`hf_dist.tracing`, ``benchmarks/trace_accuracy.py``), which runs that code. Units: bytes for one rank.

Autograd saves what a derivative formula needs, and only for inputs that need a gradient: a frozen weight (a
LoRA base) saves nothing of its input, so LoRA's activations are not full fine-tuning's (:class:`Lora`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hf_dist.planning.dtypes import FP32, Dtypes
from hf_dist.planning.moe import MoeLayout

INDEX = 8  # int64 indices (sort, topk, gather)
OFFSET = 4  # int32 (grouped_mm's per-expert offsets)
# which tensor feeds each LoRA target of a Llama-style block: targets that read one tensor share it when they save
# it unchanged (no dropout, no dtype cast); DeepSeek's latent attention reads the layer's input in q_a_proj (or q_proj)
# and kv_a_proj_with_mqa
_LORA_INPUTS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_out",
                "q_a_proj": "attn_in", "kv_a_proj_with_mqa": "attn_in"}  # fmt: skip


@dataclass(frozen=True)
class Lora:
    """One decoder layer's LoRA adapters, as PEFT's ``lora.Linear.forward`` runs them (peft/tuners/lora/layer.py):
    ``result + lora_B(lora_A(dropout(self._cast_input_dtype(x, lora_A.weight.dtype)))) * scaling``.

    ``adapters``: ``(name, in_features, rank)`` of each adapted linear (none: a frozen layer without adapters);
    ``dropout``: ``lora_dropout > 0`` (``nn.Dropout``: its output is a new tensor per adapter, plus a 1-byte mask);
    ``cast``: the adapters' dtype differs from the input's (fp32 adapters under autocast, DDP: every adapter
    casts its input to fp32, and autocast casts it back to 16-bit for ``lora_A``, a copy per adapter);
    ``input_grad``: the layer's input needs a gradient (False in the first layer that trains when nothing before it
    does: dropout there records no mask for the adapters that read the layer's input)."""

    adapters: tuple[tuple[str, int, int], ...] = ()
    dropout: bool = True
    cast: bool = False
    input_grad: bool = True


def norm_bytes(h: int, lay: Dtypes, consumers: int, liger: bool, frozen: bool = False) -> int:
    """Per token, one RMSNorm and what its consumers save of its output.

    HF ``LlamaRMSNorm`` upcasts its input to fp32 (saved by ``pow`` and the ``rsqrt`` multiply: the
    input itself when the residual is fp32, else a copy) and saves the normalised tensor cast back to
    the input dtype for the weight multiply. Liger's ``LigerRMSNormFunction`` saves only its input and
    a per-row fp32 rstd. Consumers: under autocast each linear saves its own cast of the output;
    otherwise they share one saved tensor. ``frozen`` (a LoRA base): neither the weight multiply nor the frozen
    linears save the output (their adapters do, :func:`lora_bytes`).
    """
    r = lay.residual
    if frozen:
        return r * h if liger else FP32 * h
    shared = consumers * lay.compute * h if lay.autocast else r * h
    return norm_saved_bytes(h, lay, liger) + shared


def norm_saved_bytes(h: int, lay: Dtypes, liger: bool) -> int:
    """Per token, what one RMSNorm saves for its own backward (see :func:`norm_bytes`)."""
    return lay.residual * h if liger else FP32 * h + lay.residual * h


def lora_bytes(lay: Dtypes, lora: Lora, *, attention: str = "sdpa") -> int:
    """Per token, what adapters save: ``lora_A`` its (dropped, cast) input and ``lora_B`` the rank-wide output of
    ``lora_A`` (peft ``tuners/lora/layer.py`` ``Linear.forward``). Each adapter keeps its own copy of the input when it
    applies dropout (plus the 1-byte mask ``native_dropout`` saves when the input needs a gradient, torch
    ``derivatives.yaml``) or casts it; otherwise adapters reading one tensor share it, and ``o_proj``'s adapter shares
    the attention output sdpa saved (its ``(batch, seq, heads, dim)`` output makes transformers' ``transpose(1, 2)
    .contiguous()`` a view). Found by tracing: the saved tensors of each case listed from the autograd graph."""
    c = lay.compute
    out, shared = 0, {"attn_out"} if attention != "eager" else set()
    for name, width_in, rank in lora.adapters:
        group = _LORA_INPUTS.get(name.rsplit(".", 1)[-1], name)
        out += c * rank
        if lora.dropout or lora.cast:
            mask = lora.dropout and (lora.input_grad or group != "attn_in")
            out += (c + (1 if mask else 0)) * width_in
        elif group not in shared:
            shared.add(group)
            out += c * width_in
    return out


def _mlp_bytes(spec, lay: Dtypes, liger: bool, frozen: bool, dense: bool = False) -> int:
    """Per token, the feed-forward block: a dense SwiGLU (:func:`swiglu_bytes`), or a mixture of experts
    (:func:`moe_block_bytes`); ``dense``: one of an MoE model's dense layers (DeepSeek's first)."""
    if spec.experts and not dense:
        return moe_block_bytes(spec, lay, frozen)
    width = spec.moe.dense_size if dense else spec.intermediate_size
    return swiglu_bytes(width, lay, liger, frozen)


def swiglu_bytes(width: int, lay: Dtypes, liger: bool = False, frozen: bool = False) -> int:
    """Per token, ``down(silu(gate(x)) * up(x))`` of ``width`` (modeling_llama.py ``LlamaMLP``): gate, silu(gate), up
    and their product (4cI; the product only when down_proj trains); Liger's ``LigerSiLUMulFunction`` saves gate and
    up and recomputes silu (3cI)."""
    c = lay.compute
    product = 0 if frozen else c * width  # what a trainable down_proj saves
    return (2 if liger else 3) * c * width + product


def moe_block_bytes(spec, lay: Dtypes, frozen: bool) -> int:
    """Per token, a mixture-of-experts block: the router (:func:`router_bytes`), ``experts_per_token`` routed copies
    through the experts (:func:`routed_copy_bytes`) and the shared expert(s) (:func:`shared_expert_bytes`)."""
    k = spec.experts_per_token
    return (
        router_bytes(spec, lay, frozen)
        + k * routed_copy_bytes(spec, lay, frozen)
        + shared_expert_bytes(spec, lay, frozen)
    )


def router_bytes(spec, lay: Dtypes, frozen: bool) -> int:
    """Per token, what the router saves (``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter`` / ``DeepseekV2TopkRouter``
    ``.forward``). Its input needs a gradient even when its weight is frozen (LoRA), so the fp32 softmax saves its
    output (4E, torch ``derivatives.yaml`` ``_softmax: result``) and ``topk`` its int64 indices (8k); the in-place
    renormalisation ``top_value /= top_value.sum(-1, keepdim=True)`` saves the fp32 top-k values and their sum
    (4k + 4). DeepSeek's ``F.linear(hidden_states.type(torch.float32), ...)`` saves an fp32 copy of its input for the
    weight gradient (4h; under autocast the linear's 16-bit cast of it instead) when the router trains; the input is
    already that dtype when the residual stream is fp32 without autocast."""
    moe = spec.moe or MoeLayout()
    k = spec.experts_per_token
    out = FP32 * spec.experts + INDEX * k + ((FP32 * k + FP32) if moe.renormalises else 0)
    if moe.fp32_router and not frozen:
        out += (
            lay.compute * spec.hidden_size
            if lay.autocast
            else (FP32 * spec.hidden_size if lay.residual != FP32 else 0)
        )
    return out


def routed_copy_bytes(spec, lay: Dtypes, frozen: bool) -> int:
    """Per routed copy of a token, what transformers' ``grouped_mm_experts_forward`` (integrations/moe.py, the
    default ``experts_implementation`` since 5.0, on CUDA as on CPU) saves:

    - ``hidden_states[perm // num_top_k]``, ``sample_weights[perm]`` and ``weighted_out[inv_perm]`` save their int64
      indices (3 * 8; torch ``index`` saves ``indices``);
    - the gate/up ``grouped_mm`` output (2cI): ``_default_apply_gate``'s ``chunk`` makes gate and up views of it, saved
      by silu and the product; silu's output (cI), saved by the product;
    - the down output (ch) and the routing weight (4 bytes, fp32 where the router keeps fp32 weights -- Mixtral,
      DeepSeek --; else the compute dtype), saved by ``proj_out * sample_weights_g.unsqueeze(-1)``: both need a
      gradient;
    - when the experts train: the gathered input (ch) and the product (cI), each ``grouped_mm``'s ``mat_a``, saved
      for the weight gradient (a frozen expert saves only its weight, which FSDP2 re-gathers).
    """
    c, h, inter = lay.compute, spec.hidden_size, spec.intermediate_size
    moe = spec.moe or MoeLayout()
    weight = FP32 if moe.weights_fp32 else c
    trained = 0 if frozen else c * h + c * inter
    return 3 * INDEX + 3 * c * inter + c * h + weight + trained


def shared_expert_bytes(spec, lay: Dtypes, frozen: bool) -> int:
    """Per token, the shared expert(s) every token also runs: a dense SwiGLU of ``MoeLayout.shared_size``
    (``Qwen2MoeSparseMoeBlock.shared_expert``, ``DeepseekV2Moe.shared_experts``); Qwen2-MoE scales it by
    ``F.sigmoid(self.shared_expert_gate(x)) * shared_expert_output``, whose product saves the sigmoid's output (c)
    and the shared expert's output (ch), both needing a gradient."""
    moe = spec.moe or MoeLayout()
    if not moe.shared_size:
        return 0
    gate = lay.compute * (1 + spec.hidden_size) if moe.shared_gate else 0
    return swiglu_bytes(moe.shared_size, lay, frozen=frozen) + gate


def moe_layer_constant_bytes(spec, lay: Dtypes) -> int:
    """Per MoE layer, whatever the token count: ``grouped_mm``'s int32 offsets (4E: ``torch.cumsum(...,
    dtype=torch.int32)``, saved by both grouped matmuls) and, for DeepSeek's fp32 router, the copy of its 16-bit
    weight ``self.weight.type(torch.float32)`` the linear saves for its input gradient (4hE; under autocast its
    16-bit cast of it)."""
    moe = spec.moe or MoeLayout()
    out = OFFSET * spec.experts
    if moe.fp32_router and (lay.autocast or lay.weights != FP32 or lay.compute != FP32):
        out += (lay.compute if lay.autocast else FP32) * spec.hidden_size * spec.experts
    return out


def router_logits_bytes(spec, seq_len: int, micro_batch_size: int, lay: Dtypes) -> int:
    """With ``output_router_logits`` (Mixtral, Qwen2-MoE), the load-balancing loss (``load_balancing_loss_func``)
    takes every MoE layer's router logits and applies ``softmax`` to each in its own dtype (the compute dtype): its
    output is saved until backward, for every layer, checkpointed or not (the loss is outside the checkpoints)."""
    moe = spec.moe
    if not spec.experts or moe is None or not moe.aux_logits:
        return 0
    layers = spec.num_layers - moe.dense_layers
    return layers * lay.compute * spec.experts * seq_len * micro_batch_size


def layer_gradient_bytes(
    spec, seq_len: int, micro_batch_size: int, lay: Dtypes, *, liger: bool = False, frozen: bool = False
) -> int:
    """Gradients a decoder layer's backward holds at once beyond what the layer saved: the feed-forward block's, its
    largest. Backward of ``down_proj(silu(gate(x)) * up(x))`` makes down_proj's input gradient, then from the product
    the gradients of ``silu(gate(x))`` and of ``up(x)``: three I-sized tensors in the compute dtype per token, next to
    the residual stream's gradient (h, residual dtype). Liger's ``LigerSiLUMulFunction`` writes both product gradients
    into the tensors it saved: one I-sized tensor. Found by tracing Mistral 7B under FSDP2 on 64 ranks, whose peak is
    the last layer's backward (0.83 GiB at 8k). A mixture of experts: :func:`moe_gradient_bytes` (``frozen``: LoRA).
    """
    if spec.experts:
        per_token = moe_gradient_bytes(spec, lay, frozen)
    else:
        per_token = (1 if liger else 3) * lay.compute * spec.intermediate_size
    return (per_token + lay.residual * spec.hidden_size) * seq_len * micro_batch_size


def moe_gradient_bytes(spec, lay: Dtypes, frozen: bool) -> int:
    """Per token, the most a mixture-of-experts block's backward holds beyond what it saved (the layer's input
    gradient aside), walking ``grouped_mm_experts_forward`` backwards (integrations/moe.py) per routed copy:

    - un-permuting (``weighted_out[inv_perm]``, ``.view(...).sum(dim=1)``): the expanded gradient's reshaped copy, the
      ``new_zeros`` and the ``index_put`` result (torch ``index_backward``), all in ``weighted_out``'s dtype, fp32 where
      the routing weights are (``proj_out * sample_weights_g`` promotes: 3 * 4h); the multiply's backward then holds
      its two fp32 products and the cast of the down output's gradient (ch) while ``inv_perm`` (8) is freed;
    - the experts' SwiGLU: the down ``grouped_mm``'s input gradient and the product's two (3cI), once the down output
      (ch), ``inv_perm`` and, when the experts train, the saved product (cI) are freed.
    Shared experts: DeepSeek adds them after the routed experts (``DeepseekV2Moe.forward``), so autograd runs their
    backward first: their own SwiGLU backward (3cI_s, less the freed product when they train), after which their
    saved tensors are gone and their input gradient (ch) stays. Qwen2-MoE's sigmoid gate runs first: the shared
    output's gradient and the gate's input gradient stay (2ch) while its saved sigmoid and shared output go (ch + c).
    Each moment checked against the live tensors of a tiny block's backward on fake tensors (tests/unit/planning).
    """
    moe = spec.moe or MoeLayout()
    c, h, inter = lay.compute, spec.hidden_size, spec.intermediate_size
    p = FP32 if moe.weights_fp32 else c
    unpermute = 3 * p * h + (c * h - INDEX if p != c else 0)
    experts = 3 * c * inter - c * h - INDEX - (0 if frozen else c * inter)
    routed = spec.experts_per_token * max(unpermute, experts)
    if not moe.shared_size:
        return routed
    if moe.shared_gate:
        return routed + c * h - c
    shared_first = 3 * c * moe.shared_size - (0 if frozen else c * moe.shared_size)
    return max(shared_first, routed - swiglu_bytes(moe.shared_size, lay, frozen=frozen) + c * h)


def zero3_leaf_gradient_bytes(spec, seq_len: int, micro_batch_size: int, lay: Dtypes) -> int:
    """Under ZeRO-3, where the MoE block is a leaf module (:func:`~hf_dist.planning.moe.zero3_leaf_block_params`) and
    its experts train: the most the block's backward holds beyond what the layer saved, the counterpart of
    :func:`layer_gradient_bytes` there.

    DeepSpeed hooks no parameter of a leaf module; ``stage3.py create_reduce_and_remove_grad_hooks`` registers
    ``reduce_leaf_module_grads`` as the block's full backward hook, which moves the block's gradients into the reduce
    bucket only once the whole block's backward has run. So at the gate/up ``grouped_mm``'s backward
    (``grouped_mm_experts_forward``, integrations/moe.py) every expert weight's gradient exists in the compute dtype
    (down's already accumulated, gate/up's just made: 3 x E x h x I; the shared expert's too, whose backward ran
    first), next to that ``grouped_mm``'s incoming gradient (2cI per routed copy) and its input gradient (ch), and
    the residual stream's gradient; of what the block saved (:func:`routed_copy_bytes`) the gate/up output, silu's
    output, the product (4cI together, the product saved by the training down ``grouped_mm``), the down output (ch),
    the routing weight and ``inv_perm`` are freed by then, and the shared expert's saved tensors (its input gradient,
    ch, stays). Traced on Mixtral 8x7B on 64 ranks (8k tokens): 1.75 + 0.875 GiB of expert gradients and 1 GiB of
    activation gradients at the peak."""
    moe = spec.moe or MoeLayout()
    c, h, inter = lay.compute, spec.hidden_size, spec.intermediate_size
    weight = FP32 if moe.weights_fp32 else c
    expert_grads = (3 * spec.experts * h * inter + 3 * h * moe.shared_size + (h if moe.shared_gate else 0)) * c
    per_copy = 2 * c * inter + c * h - (4 * c * inter + c * h + weight + INDEX)
    shared = c * h - shared_expert_bytes(spec, lay, frozen=False) if moe.shared_size else 0
    per_token = spec.experts_per_token * per_copy + shared + lay.residual * h
    return expert_grads + per_token * seq_len * micro_batch_size


def layer_activation_bytes(
    spec,
    seq_len: int,
    micro_batch_size: int,
    lay: Dtypes,
    *,
    attention: str = "sdpa",
    liger: bool = False,
    keys: int | None = None,
    lora: Lora | None = None,
    dense: bool = False,
    zero3_linear: bool = False,
) -> int:
    """Saved-for-backward bytes of one Llama-style decoder layer (transformers' modeling_llama.py).

    Per token, with c the compute dtype's bytes, h hidden, kv the K/V width, I the MLP width, a heads:
      two RMSNorms and their consumers (:func:`norm_bytes`; 3 projections read the first, 2 the second);
      attention: q after RoPE (c*h: RoPE's multiplies save only cos/sin, which need no grad),
        k, v (c*kv each; sdpa passes ``enable_gqa`` instead of repeating K/V), the output (c*h) and its
        contiguous transpose that o_proj saves (c*h; not when o_proj is frozen), and flash/efficient SDPA's fp32
        log-sum-exp per head (4a). Eager attention instead keeps the fp32 softmax and its 16-bit copy per key
        ((4 + c)*a*s);
      the feed-forward block (:func:`_mlp_bytes`; ``dense``: an MoE model's dense layer); with LoRA, the adapters
      (:func:`lora_bytes`). DeepSeek's latent attention: :func:`mla_attention_bytes`. ``zero3_linear``: ZeRO-3's linear
      saves the frozen linears' inputs too (:func:`zero3_frozen_linear_bytes`).
    Korthikanti et al. eq. 1 gives 34h for a GPT block in 16-bit; this block with I = 4h is larger
    because SwiGLU keeps four I-sized tensors where GELU keeps two.
    ``seq_len`` is the tokens this rank holds; ``keys`` the length each query attends over (the whole sequence
    under context / sequence parallelism; default ``seq_len``).
    """
    keys = seq_len if keys is None else keys
    h, kv, a, c = spec.hidden_size, spec.num_key_value_heads * spec.head_dim, spec.num_attention_heads, lay.compute
    q = spec.num_attention_heads * spec.head_dim
    frozen = lora is not None
    mla = spec.mla
    # the first norm feeds q, k, v (latent attention: q and the kv latent) and the second gate, up; extra norms
    # (Gemma 2/3's post-attention and post-feed-forward norms) feed one consumer each; latent attention's own norms
    # are the attention's (mla_attention_bytes)
    latent_norms = (1 + bool(mla.q_lora_rank)) if mla else 0
    extra = max(spec.norms_per_layer - 2 - latent_norms, 0)
    norms = sum(norm_bytes(h, lay, n, liger, frozen) for n in (2 if mla else 3, 2, *([1] * extra)))
    attn = mla_attention_bytes(spec, lay, frozen) if mla else c * ((2 if frozen else 3) * q + 2 * kv)
    # eager: the fp32 softmax and its 16-bit copy per key; Gemma 2 soft-caps the scores first (scores / cap, tanh,
    # * cap), which saves tanh's output per key too (modeling_gemma2.py eager_attention_forward)
    per_key = FP32 + c + (c if spec.attention_softcapping else 0)
    attn += per_key * a * keys if attention == "eager" else FP32 * a
    adapters = lora_bytes(lay, lora, attention=attention) if lora is not None else 0
    per_token = norms + attn + _mlp_bytes(spec, lay, liger, frozen, dense) + adapters
    if zero3_linear and lora is not None and not mla:
        per_token += zero3_frozen_linear_bytes(spec, lay, lora, dense)
    constant = moe_layer_constant_bytes(spec, lay) if spec.experts and not dense else 0
    return per_token * seq_len * micro_batch_size + constant


def zero3_frozen_linear_bytes(spec, lay: Dtypes, lora: Lora, dense: bool = False) -> int:
    """Per token, what ZeRO-3's linear saves of a LoRA layer's frozen linears beyond what torch's would.

    ZeRO-3 replaces ``torch.nn.functional.linear`` with ``zero3_linear_wrap`` (``partition_parameters.py
    _enable_mem_efficient_linear``, on with ``memory_efficient_linear``, DeepSpeed's default; the Trainer builds the
    model under ``zero.Init``), whose ``LinearFunctionForZeroStage3.setup_context`` saves its input whether or not the
    weight needs a gradient (``runtime/zero/linear.py``); torch's linear with a frozen weight saves only the weight. So
    each tensor a frozen base linear reads is kept: the first norm's output (q/k/v), the second's (gate/up, or an MoE
    block's router) and the dense MLP's product (down_proj; a shared expert's), each once (16-bit), unless an adapter
    already saves that same tensor (no dropout, no cast: :func:`lora_bytes` shares it). o_proj's input is the attention
    output sdpa saved (a view). Traced on Mixtral 8x7B LoRA under ZeRO-3: the two norms' outputs, 64 MiB each at 8k
    tokens, in the recomputed layer."""
    moe = spec.moe or MoeLayout()
    saved = (
        set()
        if lora.dropout or lora.cast
        else {_LORA_INPUTS.get(n.rsplit(".", 1)[-1], n) for n, _, _ in lora.adapters}
    )
    widths = {"attn_in": spec.hidden_size, "mlp_in": spec.hidden_size}
    if dense or not spec.experts:
        widths["mlp_out"] = moe.dense_size if dense else spec.intermediate_size
    elif moe.shared_size:
        widths["mlp_out"] = moe.shared_size
    return lay.compute * sum(width for group, width in widths.items() if group not in saved)


def mla_attention_bytes(spec, lay: Dtypes, frozen: bool) -> int:
    """Per token, DeepSeek-V2's multi-head latent attention (``modeling_deepseek_v2.py DeepseekV2Attention.forward``)
    as CUDA runs it. Its query/key head (``qk_nope + qk_rope``) is wider than its value head, which CUDA's flash
    kernel refuses (``sdp_utils.cpp check_head_dim_size_flash``: equal head dims), so sdpa takes the memory-efficient
    kernel, which saves query, key, value, output and an fp32 log-sum-exp per head (``derivatives.yaml``
    ``_scaled_dot_product_efficient_attention``):
      the query (``torch.cat((q_nope, q_pe))``, c*a*dqk) and the key (``expand_kv``'s ``new_empty`` + ``copy_``,
        c*a*dqk); the value is a view of ``kv_b_proj``'s output, so that whole output stays (c*a*(nope + dv));
      the output (c*a*dv: the kernel's (batch, seq, heads, dim) layout makes transformers' ``transpose(1, 2)
        .contiguous()`` and ``reshape`` views, so ``o_proj`` saves the same tensor); the log-sum-exp (4a);
      the latent norms (``kv_a_layernorm``, and ``q_a_layernorm`` with a ``q_lora_rank``: :func:`_latent_norm_bytes`).
    RoPE (``apply_rotary_emb``) multiplies fp32 complex copies by ``freqs_cis``, which needs no gradient: it saves
    only ``freqs_cis``, one tensor for every layer.
    """
    m, c, a = spec.mla, lay.compute, spec.num_attention_heads
    norms = _latent_norm_bytes(m.kv_lora_rank, lay, frozen)
    norms += _latent_norm_bytes(m.q_lora_rank, lay, frozen) if m.q_lora_rank else 0
    return norms + c * a * (2 * m.qk_head_dim + m.qk_nope + 2 * m.v_head_dim) + FP32 * a


def _latent_norm_bytes(width: int, lay: Dtypes, frozen: bool) -> int:
    """Per token, an RMSNorm over a projection's 16-bit output (``DeepseekV2RMSNorm`` on the kv / q latent): its fp32
    copy (``.to(torch.float32)``, saved by ``pow`` and the ``rsqrt`` multiply) and the fp32 ``rsqrt`` per row; when
    its weight and the next linear train, the normalised tensor cast back (saved by the weight multiply) and the
    norm's output (saved by the next linear, or its 16-bit cast under autocast)."""
    return FP32 * width + FP32 + (0 if frozen else 2 * lay.compute * width)


def activation_bytes(
    spec, seq_len, micro_batch_size, activation_checkpointing, lay: Dtypes, *, lora_layers=None, idle_layers=0, **kw
) -> tuple[int, int]:
    """(saved activations of every decoder layer on one rank, the part of them that exists only while one layer
    is recomputed). Data parallelism does not split them.

    With activation checkpointing (non-reentrant, one checkpoint per decoder layer, what hf_dist
    configures) each layer keeps only its input (residual dtype), plus one layer's activations while it
    is recomputed in backward -- not while the loss's logits are alive, which come before any recompute.
    LoRA: ``lora_layers`` holds each decoder layer's adapters (:class:`Lora`); the first ``idle_layers`` see no
    input that needs a gradient, and autograd records nothing there.
    """
    if not spec.has_shape:
        return 0, 0
    children = kw.pop("checkpoint_children", False)
    loras = lora_layers if lora_layers is not None else (None,) * spec.num_layers
    dense = spec.moe.dense_layers if spec.experts and spec.moe else 0  # DeepSeek's first layers are dense
    kinds = Counter((lora, i < dense) for i, lora in enumerate(loras) if i >= idle_layers)
    per_kind = {
        kind: layer_activation_bytes(spec, seq_len, micro_batch_size, lay, lora=kind[0], dense=kind[1], **kw)
        for kind in kinds
    }
    largest = max(per_kind.values(), default=0)
    if activation_checkpointing:
        # one checkpoint per layer saves its input; one per child (the norms, attention and MLP: accelerate <= 1.14's
        # FSDP2 checkpointing) saves each child's input, all hidden-sized
        saved = spec.norms_per_layer + 2 if children else 1
        busy = sum(kinds.values())
        inputs = busy * saved * spec.hidden_size * seq_len * micro_batch_size * lay.residual
        return inputs + largest + router_logits_bytes(spec, seq_len, micro_batch_size, lay), largest
    every = sum(per_kind[kind] * count for kind, count in kinds.items())
    return every + router_logits_bytes(spec, seq_len, micro_batch_size, lay), 0
