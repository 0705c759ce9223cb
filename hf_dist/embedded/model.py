"""The embedded default model: a Llama small enough for 2 CPU ranks to train in seconds."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` of 2 layers, hidden 64, GQA 4:2; ``overrides`` replace any field."""
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)
