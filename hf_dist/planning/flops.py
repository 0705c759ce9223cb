"""Training FLOPs per token and model FLOPs utilization (MFU), pure math.

Formula (PaLM, Chowdhery et al. 2022, appendix B; Kaplan et al. 2020, "Scaling Laws", section 2.1):

    flops_per_token = 6 * N + 12 * L * H * Q * T

``6 * N``: a forward pass costs 2 FLOPs per parameter per token (one multiply, one add) and the
backward pass twice that. ``N`` counts the parameters used in matmuls: the input embedding is a
lookup, so it is left out unless it is tied to the LM head (which is a matmul).
``12 * L * H * Q * T``: the attention score and value matmuls (QK^T and AV), which have no
parameters: 2 matmuls * 2 FLOPs * L layers * (H heads * Q head dim = hidden size) * T context,
times 3 for forward + backward. Like PaLM, causal masking is not discounted and recomputation
from activation checkpointing is not counted, so MFU is comparable across runs and papers.
"""

from __future__ import annotations

from typing import Any


def training_flops_per_token(
    *,
    num_params: int,
    num_layers: int,
    hidden_size: int,
    seq_len: int,
    embedding_params: int = 0,
    tie_word_embeddings: bool = False,
) -> int:
    """FLOPs to train on one token (forward + backward), PaLM appendix B."""
    for name, value in (("num_params", num_params), ("num_layers", num_layers), ("seq_len", seq_len)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    matmul_params = num_params if tie_word_embeddings else num_params - embedding_params
    if matmul_params < 0:
        raise ValueError(
            f"embedding_params ({embedding_params}) exceeds num_params ({num_params}); pass the input embedding size"
        )
    return 6 * matmul_params + 12 * num_layers * hidden_size * seq_len


def flops_per_token_from_spec(spec: Any, seq_len: int) -> int:
    """``training_flops_per_token`` for a ``hf_dist.ModelSpec`` (or any object with the same fields)."""
    return training_flops_per_token(
        num_params=spec.num_params,
        num_layers=spec.num_layers,
        # H heads x Q head dim: the hidden size, unless the config sets head_dim (Gemma) or TP split the heads
        hidden_size=(spec.num_attention_heads * spec.head_dim) or spec.hidden_size,
        seq_len=seq_len,
        embedding_params=spec.embedding_params,
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops_per_second: float) -> float:
    """Model FLOPs utilization: achieved model FLOPs / peak FLOPs of the same devices (0..1).

    ``tokens_per_second`` and ``peak_flops_per_second`` must describe the same set of devices
    (one rank, or all ranks together).
    """
    if peak_flops_per_second <= 0:
        raise ValueError(f"peak_flops_per_second must be > 0, got {peak_flops_per_second}")
    return tokens_per_second * flops_per_token / peak_flops_per_second


def scaling_efficiency(throughput_n: float, world_size: int, throughput_1: float) -> float:
    """throughput_N / (N * throughput_1): 1.0 is perfect linear scaling."""
    if world_size < 1 or throughput_1 <= 0:
        raise ValueError(f"need world_size >= 1 and throughput_1 > 0, got {world_size} and {throughput_1}")
    return throughput_n / (world_size * throughput_1)


# ---------------------------------------------------------------- what a training step really computes
# (the step-time model, hf_dist.planning.throughput; MFU above keeps PaLM's convention)


def matmul_flops_per_token(
    *, matmul_params: int, trainable_matmul_params: int, recomputed_matmul_params: int = 0
) -> int:
    """FLOPs of the linear layers for one token: 2 per weight in forward, 2 per weight for the input gradient in
    backward, 2 per *trainable* weight for the weight gradient (autograd computes no gradient for a frozen weight:
    a LoRA base pays 4 of the 6), and 2 per weight run forward again under activation checkpointing
    (``recomputed_matmul_params``: the decoder layers', frozen or not; the LM head is never recomputed). Kaplan et al.
    2020 sec. 2.1 for the 2-per-weight forward and the 2x backward."""
    return 4 * matmul_params + 2 * trainable_matmul_params + 2 * recomputed_matmul_params


def attention_flops_per_token(
    *, num_layers: int, query_width: int, keys: int, flash: bool = True, recomputed: bool = False
) -> int:
    """FLOPs of the attention matmuls (``QK^T`` and ``AV``) for one query token over ``keys`` keys, all layers.

    A matmul of a query against one key costs 2 FLOPs per element of ``query_width`` (heads x head_dim), so forward
    is ``2 * 2 * query_width`` per attended key. Flash attention (sdpa's flash / memory-efficient kernels, causal) skips
    the masked half: ``(keys + 1) / 2`` keys per query on average; its backward recomputes ``QK^T`` and runs ``dV``,
    ``dP``, ``dQ`` and ``dK``: five matmuls to forward's two, 2.5x (Dao 2023, "FlashAttention-2", Algorithm 2).
    Eager attention multiplies the full ``[queries, keys]`` matrix and masks it afterwards, and its backward is four
    matmuls (2x). ``recomputed``: activation checkpointing runs the forward once more."""
    attended = (keys + 1) / 2 if flash else keys
    forward = 4 * query_width * attended * num_layers
    backward = forward * (2.5 if flash else 2.0)
    return int(forward * (2 if recomputed else 1) + backward)
