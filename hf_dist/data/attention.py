"""Document-aware sdpa: packed sequences kept apart by the attention itself, from the ``position_ids`` it is given.

transformers separates packed sequences while it builds the mask (``masking_utils.find_packed_sequence_indices``).
Under DeepSpeed's Ulysses sequence parallelism that mask is built for each rank's slice of the row and then dropped:
the attention DeepSpeed wraps runs over the whole gathered row with ``attention_mask=None`` and the row's gathered
``position_ids``; plain sdpa then attends causally across every sequence of the row. This attention reads those
``position_ids`` and attends only within each sequence (a plain causal sdpa where a row holds one sequence). Load
the model with ``attn_implementation=DOCUMENT_SDPA`` and give DeepSpeed's handler the same name, after
:func:`register_document_attention` (the recipes do both when they pack under sequence parallelism).
"""

from __future__ import annotations

from typing import Any

DOCUMENT_SDPA = "hf_dist_sdpa"


def register_document_attention() -> str:
    """Register :data:`DOCUMENT_SDPA` with transformers (its attention and its mask builder, sdpa's); idempotent.
    Returns the name to load the model with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DOCUMENT_SDPA, document_sdpa)
    AttentionMaskInterface.register(DOCUMENT_SDPA, sdpa_mask)
    return DOCUMENT_SDPA


def document_mask(position_ids: Any, length: int) -> Any | None:
    """A boolean ``(rows, 1, length, length)`` mask, causal within each sequence of ``position_ids`` (restarting at
    0 where one begins); None where every row holds one sequence (plain causal attention does)."""
    import torch

    pos = position_ids.reshape(-1, length)
    starts = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return None
    sequence = starts.cumsum(-1)
    same = sequence[:, :, None] == sequence[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=pos.device).tril()
    return (same & causal)[:, None]


def document_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any):
    """transformers' sdpa, with the per-sequence mask of ``kwargs["position_ids"]`` when no mask is given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if attention_mask is None and position_ids is not None:
        attention_mask = document_mask(position_ids, query.shape[-2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
