"""What the LM head and the loss hold at their peak, per rank: transformers' loss (fp32 logits), Liger's fused linear
cross-entropy, TRL's fused LM head; and the largest single tensor of a step. Pure arithmetic, bytes, as
:mod:`hf_dist.planning.activations` is for the decoder layers."""

from __future__ import annotations

import math

from hf_dist.planning.activations import norm_bytes, norm_saved_bytes
from hf_dist.planning.dtypes import FP32, Dtypes

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
    final_norm = norm_saved_bytes(h, lay, liger) * tokens  # its output is not saved: the head saves a copy
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
    final_norm = norm_bytes(spec.hidden_size, lay, 1, liger) * tokens
    if not liger:
        # Gemma 2's soft-capping (logits / cap, tanh, * cap) saves tanh's output in the compute dtype
        capping = lay.compute * spec.vocab_size * tokens if spec.logit_softcapping else 0
        return final_norm + 3 * FP32 * spec.vocab_size * tokens + capping
    h, v = spec.hidden_size, spec.vocab_size
    chunk = min(2 ** math.ceil(math.log2(max(1, math.ceil(tokens / math.ceil(v / h))))), tokens)
    weight_copy = lay.compute * v * h if lay.autocast else 0
    return final_norm + lay.residual * h * tokens + lay.weights * v * h + weight_copy + lay.compute * v * chunk


def largest_transient_bytes(spec, seq_len, micro_batch_size, lay: Dtypes, liger: bool, trl_head: bool = False) -> int:
    """The largest single tensor of a step: an MLP activation, the fp32 logits, or TRL's fp32 weight gradient."""
    if not spec.has_shape:
        return 0
    tokens = seq_len * micro_batch_size
    mlp = lay.compute * spec.intermediate_size * tokens * max(spec.experts_per_token, 1)
    if trl_head:
        return max(mlp, FP32 * spec.vocab_size * spec.hidden_size)
    return mlp if liger else max(mlp, FP32 * spec.vocab_size * tokens)
