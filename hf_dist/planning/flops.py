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
