"""What a decoder layer and the LM head save for backward, per rank: pure arithmetic, bytes.

Each term follows what the HF implementation saves, tensor by tensor (transformers' modeling_llama.py and
friends; PEFT's ``lora.Linear``; transformers' ``integrations/moe.py``), and was checked against the tracer
(:mod:`hf_dist.tracing`, ``benchmarks/trace_accuracy.py``), which runs that code. Units: bytes for one rank.

Autograd saves what a derivative formula needs, and only for inputs that need a gradient: a frozen weight (a
LoRA base) saves nothing of its input, so LoRA's activations are not full fine-tuning's (:class:`Lora`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from hf_dist.planning.dtypes import FP32, Dtypes

INDEX = 8  # int64 indices (sort, topk, gather)
# which tensor feeds each LoRA target of a Llama-style block: targets that read one tensor share it when they save
# it unchanged (no dropout, no dtype cast)
_LORA_INPUTS = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "attn_out",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "mlp_out"}  # fmt: skip


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


def _norm_bytes(h: int, lay: Dtypes, consumers: int, liger: bool, frozen: bool = False) -> int:
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
    return _norm_saved_bytes(h, lay, liger) + shared


def _norm_saved_bytes(h: int, lay: Dtypes, liger: bool) -> int:
    """Per token, what one RMSNorm saves for its own backward (see :func:`_norm_bytes`)."""
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


def _mlp_bytes(spec, lay: Dtypes, liger: bool, frozen: bool) -> int:
    """Per token, the feed-forward block.

    Dense SwiGLU: gate, silu(gate), up and their product (4cI; the product only when down_proj trains); Liger's
    ``LigerSiLUMulFunction`` saves gate and up and recomputes silu (3cI). Mixture of experts (transformers'
    ``grouped_mm_experts_forward``, ``experts_per_token`` k routed copies of each token): the router's fp32
    softmax (4E), top-k, sort and gather indices, and per copy the gathered input and the down output (2ch,
    saved by the grouped matmuls and the fp32 routing-weight multiply), the gate/up projection and silu (3cI),
    the down input (cI) -- the inputs only when the experts train.
    """
    c, inter = lay.compute, spec.intermediate_size
    if spec.experts:
        k = spec.experts_per_token
        per_copy = 3 * c * inter + (0 if frozen else 2 * c * spec.hidden_size + c * inter) + FP32 + 3 * INDEX
        return k * per_copy + FP32 * spec.experts
    product = 0 if frozen else c * inter  # what a trainable down_proj saves
    return (2 if liger else 3) * c * inter + product


def layer_gradient_bytes(spec, seq_len: int, micro_batch_size: int, lay: Dtypes, *, liger: bool = False) -> int:
    """Gradients a decoder layer's backward holds at once beyond what the layer saved: the feed-forward block's, its
    largest. Backward of ``down_proj(silu(gate(x)) * up(x))`` makes down_proj's input gradient, then from the product
    the gradients of ``silu(gate(x))`` and of ``up(x)``: three I-sized tensors in the compute dtype per token (per
    routed copy of a token in a mixture of experts), next to the residual stream's gradient (h, residual dtype).
    Liger's ``LigerSiLUMulFunction`` writes both product gradients into the tensors it saved: one I-sized tensor.
    Found by tracing Mistral 7B under FSDP2 on 64 ranks, whose peak is the last layer's backward (0.83 GiB at 8k).
    """
    copies = spec.experts_per_token if spec.experts else 1
    per_token = (1 if liger else 3) * lay.compute * spec.intermediate_size * copies + lay.residual * spec.hidden_size
    return per_token * seq_len * micro_batch_size


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
) -> int:
    """Saved-for-backward bytes of one Llama-style decoder layer (transformers' modeling_llama.py).

    Per token, with c the compute dtype's bytes, h hidden, kv the K/V width, I the MLP width, a heads:
      two RMSNorms and their consumers (:func:`_norm_bytes`; 3 projections read the first, 2 the second);
      attention: q after RoPE (c*h: RoPE's multiplies save only cos/sin, which need no grad),
        k, v (c*kv each; sdpa passes ``enable_gqa`` instead of repeating K/V), the output (c*h) and its
        contiguous transpose that o_proj saves (c*h; not when o_proj is frozen), and flash/efficient SDPA's fp32
        log-sum-exp per head (4a). Eager attention instead keeps the fp32 softmax and its 16-bit copy per key
        ((4 + c)*a*s);
      the feed-forward block (:func:`_mlp_bytes`); with LoRA, the adapters (:func:`lora_bytes`).
    Korthikanti et al. eq. 1 gives 34h for a GPT block in 16-bit; this block with I = 4h is larger
    because SwiGLU keeps four I-sized tensors where GELU keeps two.
    ``seq_len`` is the tokens this rank holds; ``keys`` the length each query attends over (the whole sequence
    under context / sequence parallelism; default ``seq_len``).
    """
    keys = seq_len if keys is None else keys
    h, kv, a, c = spec.hidden_size, spec.num_key_value_heads * spec.head_dim, spec.num_attention_heads, lay.compute
    q = spec.num_attention_heads * spec.head_dim
    frozen = lora is not None
    # the first norm feeds q, k, v and the second gate, up; extra norms (Gemma 2/3's post-attention and
    # post-feed-forward norms) feed one consumer each
    extra = max(spec.norms_per_layer - 2, 0)
    norms = sum(_norm_bytes(h, lay, n, liger, frozen) for n in (3, 2, *([1] * extra)))
    attn = c * ((2 if frozen else 3) * q + 2 * kv)
    # eager: the fp32 softmax and its 16-bit copy per key; Gemma 2 soft-caps the scores first (scores / cap, tanh,
    # * cap), which saves tanh's output per key too (modeling_gemma2.py eager_attention_forward)
    per_key = FP32 + c + (c if spec.attention_softcapping else 0)
    attn += per_key * a * keys if attention == "eager" else FP32 * a
    adapters = lora_bytes(lay, lora, attention=attention) if lora is not None else 0
    return (norms + attn + _mlp_bytes(spec, lay, liger, frozen) + adapters) * seq_len * micro_batch_size


# TRL's fused LM head (trl.kernels.chunked_logprob): tokens per projection tile, and the vocabulary width of a tile
# (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)
TRL_TOKEN_TILE = 4096
TRL_VOCAB_TILE = 32768


def trl_head_bytes(
    spec, tokens: int, lay: Dtypes, *, trains_head: bool, weight_bytes: int | None = None, liger: bool = False
) -> int:
    """Peak bytes of TRL's fused LM head (``SFTTrainer``'s loss since TRL 1.x: ``add_fused_lm_head`` and
    ``_ChunkedLogProbFunction``), at the end of its backward, on top of what the layers saved.

    The forward scores ``[4096 tokens, 32768 vocab]`` tiles of one reused buffer (compute dtype) and saves a copy
    of the final hidden states (``hidden_states[mask]``, residual dtype), never the logits. The backward recomputes
    each tile and accumulates, always in fp32, the input gradient ``[tokens, hidden]`` and, when the head trains,
    the weight gradient ``[vocab, hidden]``; on return both are cast to their inputs' dtypes while the fp32 buffers
    are alive. Under autocast each tile's weight slice is cast to the compute dtype. ``weight_bytes``: the head's
    weight as the forward sees it (FSDP2 gathers it in the compute dtype; default ``lay.weights``).
    """
    h, v = spec.hidden_size, spec.vocab_size
    final_norm = _norm_saved_bytes(h, lay, liger) * tokens  # its output is not saved: the head saves a copy
    tile = lay.compute * min(tokens, TRL_TOKEN_TILE) * min(v, TRL_VOCAB_TILE)
    weight_slice = lay.compute * min(v, TRL_VOCAB_TILE) * h if lay.autocast else 0
    grad_hidden = FP32 * tokens * h + (lay.residual * tokens * h if lay.residual != FP32 else 0)
    weights = lay.weights if weight_bytes is None else weight_bytes
    grad_weight = (FP32 * v * h + (weights * v * h if weights != FP32 else 0)) if trains_head else 0
    return final_norm + lay.residual * tokens * h + tile + weight_slice + grad_hidden + grad_weight


def logits_bytes(spec, seq_len: int, micro_batch_size: int, lay: Dtypes, *, liger: bool = False) -> int:
    """Peak bytes of the LM head and the loss.

    HF: ``ForCausalLMLoss`` upcasts the logits (``logits.float()``) and ``cross_entropy`` keeps the fp32
    log-softmax; in backward NLL's gradient, the log-softmax output and its input gradient are three
    fp32 ``[tokens, vocab]`` tensors alive at once (12 bytes per vocab entry per token), more than the
    forward's 16-bit logits + fp32 copy + log-softmax. Plus the final norm and what lm_head saves.
    Liger's fused linear cross-entropy (``LigerFusedLinearCrossEntropyFunction``) computes the loss and
    both gradients chunk by chunk in forward: it keeps the input gradient (in the residual dtype) and the
    lm_head weight gradient (in the weights' dtype), and holds one chunk of logits of
    ``2**ceil(log2(tokens / ceil(V / h)))`` rows; under autocast each chunk's matmul casts the transposed
    fp32 weight again (a view, which autocast does not cache).
    """
    tokens = seq_len * micro_batch_size
    final_norm = _norm_bytes(spec.hidden_size, lay, 1, liger) * tokens
    if not liger:
        # Gemma 2's soft-capping (logits / cap, tanh, * cap) saves tanh's output in the compute dtype
        capping = lay.compute * spec.vocab_size * tokens if spec.logit_softcapping else 0
        return final_norm + 3 * FP32 * spec.vocab_size * tokens + capping
    h, v = spec.hidden_size, spec.vocab_size
    chunk = min(2 ** math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(v / h))))), tokens)
    weight_copy = lay.compute * v * h if lay.autocast else 0
    return final_norm + lay.residual * h * tokens + lay.weights * v * h + weight_copy + lay.compute * v * chunk


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
    kinds = Counter(lora_layers[idle_layers:]) if lora_layers is not None else Counter({None: spec.num_layers})
    per_kind = {lora: layer_activation_bytes(spec, seq_len, micro_batch_size, lay, lora=lora, **kw) for lora in kinds}
    largest = max(per_kind.values(), default=0)
    if activation_checkpointing:
        # one checkpoint per layer saves its input; one per child (the norms, attention and MLP: accelerate <= 1.14's
        # FSDP2 checkpointing) saves each child's input, all hidden-sized
        saved = spec.norms_per_layer + 2 if children else 1
        busy = sum(kinds.values())
        inputs = busy * saved * spec.hidden_size * seq_len * micro_batch_size * lay.residual
        return inputs + largest, largest
    return sum(per_kind[lora] * count for lora, count in kinds.items()), 0


def largest_transient_bytes(spec, seq_len, micro_batch_size, lay: Dtypes, liger: bool, trl_head: bool = False) -> int:
    """The largest single tensor of a step: an MLP activation, the fp32 logits, or TRL's fp32 weight gradient."""
    if not spec.has_shape:
        return 0
    tokens = seq_len * micro_batch_size
    mlp = lay.compute * spec.intermediate_size * tokens * max(spec.experts_per_token, 1)
    if trl_head:
        return max(mlp, FP32 * spec.vocab_size * spec.hidden_size)
    return mlp if liger else max(mlp, FP32 * spec.vocab_size * tokens)
