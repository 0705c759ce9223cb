"""Attention as CUDA runs it, for shapes where the CPU kernels the trace runs save something else.

torch's CPU sdpa takes its flash kernel only when query, key and value share one head dim; CUDA's flash kernel has the
same rule (``sdp_utils.cpp check_head_dim_size_flash``), and what both save then agrees (docs/planner.md, "Tracing").
Where the value head differs (DeepSeek-V2/V3's latent attention: 192-wide query/key heads, 128-wide value heads) the
two part: CUDA takes the memory-efficient kernel (``check_head_dim_size_mem_efficient`` allows a different value head),
which saves query, key, value, output and an fp32 log-sum-exp per head; the CPU falls back to the math path, which
upcasts a bf16 query, key and value to fp32 and saves the fp32 ``[seq, seq]`` softmax of every head (1 GiB a layer
for DeepSeek-V2-Lite at 4k tokens). The trace predicts a GPU run, so there it calls the efficient kernel itself:
FakeTensorMode runs its meta implementation (``torch/_meta_registrations.py``), whatever the fake device.
"""

from __future__ import annotations

import contextlib
from typing import Any


def cuda_takes_efficient(query: Any, key: Any, value: Any, enable_gqa: bool = False) -> bool:
    """Whether CUDA's sdpa picks the memory-efficient kernel where the CPU would take its math path: 16-bit 4-d
    inputs whose query and key heads match while the value head differs (flash refuses that), every head a multiple
    of 8 elements (the kernel's 16-bit alignment), and no grouped-query broadcast (which the efficient kernel lacks).
    Only fake tensors qualify: real CPU tensors have no efficient kernel to run."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    dims = (query.size(-1), key.size(-1), value.size(-1))
    return (
        is_fake(query)
        and query.dim() == 4
        and query.dtype in (torch.bfloat16, torch.float16)
        and dims[0] == dims[1] != dims[2]
        and all(d % 8 == 0 for d in dims)
        and not (enable_gqa and query.size(1) != key.size(1))
    )


@contextlib.contextmanager
def cuda_attention():
    """``torch.nn.functional.scaled_dot_product_attention`` calls CUDA's memory-efficient kernel where CUDA would
    (:func:`cuda_takes_efficient`); every other call runs unchanged. A boolean mask becomes the additive mask of the
    query's dtype that sdpa builds for that kernel (``attention.cpp convert_boolean_attn_mask``)."""
    import torch

    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not cuda_takes_efficient(query, key, value, enable_gqa):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, lse, dropout_p, is_causal, scale=scale
        )[0]

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
