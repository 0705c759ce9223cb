"""Sequence packing for continued pretraining: documents → fixed-length blocks, no padding."""

from __future__ import annotations

from collections.abc import Iterable


def pack_sequences(documents: Iterable[list[int]], block_size: int, *, eos_token_id: int | None) -> list[list[int]]:
    """Concatenate token lists (each followed by ``eos_token_id``) and cut them into ``block_size`` blocks.

    Every training token is a real token (no pad, no wasted compute). Documents share a block
    without an attention barrier, as in GPT-2/Llama pretraining; eos marks the boundary. The
    trailing remainder shorter than a block is dropped, so at most ``block_size - 1`` tokens are lost.
    """
    if block_size < 2:
        raise ValueError(f"block_size={block_size} must be >= 2 (one input and one target token)")
    blocks: list[list[int]] = []
    buffer: list[int] = []
    for doc in documents:
        buffer.extend(doc)
        if eos_token_id is not None:
            buffer.append(eos_token_id)
        while len(buffer) >= block_size:
            blocks.append(buffer[:block_size])
            buffer = buffer[block_size:]
    return blocks


def pack_batch(batch: dict[str, list], *, tokenizer, block_size: int, text_column: str = "text") -> dict[str, list]:
    """``datasets.map(batched=True)`` function: tokenize a batch of raw text and pack it."""
    ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
    blocks = pack_sequences(ids, block_size, eos_token_id=tokenizer.eos_token_id)
    return {
        "input_ids": blocks,
        "attention_mask": [[1] * block_size for _ in blocks],
        "labels": [b[:] for b in blocks],
    }
