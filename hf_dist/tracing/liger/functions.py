"""Fake Liger autograd functions: what liger-kernel 0.8.5's Triton functions allocate and save, and no kernel.

Each class is one ``torch.autograd.Function`` of liger-kernel 0.8.5 (``liger_kernel/ops/``), copied tensor for
tensor: the same outputs (shape, dtype and storage: a kernel that writes into its input returns that input), the same
saved tensors, the same temporaries, allocated and dropped in the same order. The Triton kernels are left out: they
only write into tensors allocated around them. Nothing is computed; these run under ``FakeTensorMode``, where a
tensor is its shape, dtype and storage. Where Liger's code branches on the device, the branch is the GPU the trace
predicts (CUDA, compute capability >= 8), with the trace's CPU autocast standing in for CUDA's.
"""

from __future__ import annotations

from typing import Any

import torch

# SMs of the GPU: rms_norm_backward's fp32 partial weight gradient has one row per SM
# (torch.cuda.get_device_properties(...).multi_processor_count; 132 on an H100 SXM and on an H200)
SM_COUNT = 132


class FakeRMSNormFunction(torch.autograd.Function):
    """``LigerRMSNormFunction`` (ops/rms_norm.py ``rms_norm_forward`` / ``rms_norm_backward``).

    Forward: ``Y`` like ``X`` and a per-row ``rstd`` (fp32 under the llama and gemma casting modes, else ``X``'s
    dtype); saves ``X``, ``W`` and ``rstd``. Backward: an fp32 ``[SMs, hidden]`` partial of the weight gradient when
    ``W`` trains, the input gradient written into ``dY`` (``in_place``, the llama default) or into
    ``zeros_like(dY)``, and ``dW = partial.sum(0).to(W.dtype)``."""

    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):  # noqa: N803
        X = X.contiguous()  # @ensure_contiguous
        shape = X.shape
        X = X.view(-1, shape[-1])
        Y = torch.empty((X.shape[0], X.shape[1]), dtype=X.dtype, device=X.device)  # noqa: N806
        fp32 = casting_mode in ("llama", "gemma", 0, 1)  # _CASTING_MODE_LLAMA, _CASTING_MODE_GEMMA
        rstd = torch.empty(X.shape[0], dtype=torch.float32 if fp32 else X.dtype, device=X.device)
        ctx.in_place, ctx.affine = in_place, W is not None
        ctx.save_for_backward(*((X, W, rstd) if W is not None else (X, rstd)))
        return Y.view(*shape)

    @staticmethod
    def backward(ctx, dY):  # noqa: N803
        dY = dY.contiguous()  # @ensure_contiguous
        W = ctx.saved_tensors[1] if ctx.affine else None  # noqa: N806
        shape = dY.shape
        dY = dY.view(-1, shape[-1])
        needs_dw = ctx.affine and ctx.needs_input_grad[1]
        partial = torch.empty((SM_COUNT, shape[-1]), dtype=torch.float32, device=dY.device) if needs_dw else None
        dX = dY if ctx.in_place else torch.zeros_like(dY)  # noqa: N806
        dW = partial.sum(dim=0).to(W.dtype) if needs_dw else None  # noqa: N806
        return dX.view(*shape), dW, None, None, None, None, None


class FakeSiLUMulFunction(torch.autograd.Function):
    """``LigerSiLUMulFunction`` (ops/swiglu.py ``swiglu_forward`` / ``swiglu_backward``): forward allocates the
    product like ``a`` and saves ``a`` and ``b`` (silu is recomputed); backward writes the two input gradients into
    the saved ``a`` and ``b`` and returns them: nothing new."""

    @staticmethod
    def forward(ctx, a, b, gate_multiplier=1.0, down_multiplier=1.0):
        a, b = a.contiguous(), b.contiguous()  # @ensure_contiguous
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        c = torch.empty_like(a).view(*shape)
        if float(down_multiplier) != 1.0:
            c = c * float(down_multiplier)
        ctx.down_multiplier = float(down_multiplier)
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc):
        dc = dc.contiguous()  # @ensure_contiguous
        a, b = ctx.saved_tensors
        if ctx.down_multiplier != 1.0:
            dc = dc * ctx.down_multiplier
        return a.view(*dc.shape), b.view(*dc.shape), None, None


def _rope_layout(q, k, cos, sin, unsqueeze_dim):
    """``rope_forward``'s views: cos/sin squeezed to 3-d, q/k back to their physical ``[b, s, heads, d]`` layout
    (``.contiguous()``: a no-op for the projections' outputs, a copy otherwise)."""
    if cos.ndim == 4:
        dim = unsqueeze_dim if cos.shape[unsqueeze_dim] == 1 else 1 if cos.shape[1] == 1 else None
        cos, sin = (cos.squeeze(dim), sin.squeeze(dim)) if dim is not None else (cos.squeeze(), sin.squeeze())
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    return q, k, cos.contiguous(), sin.contiguous()


class FakeRopeFunction(torch.autograd.Function):
    """``LigerRopeFunction`` (ops/rope.py, the ``nvidia-triton`` implementation ``liger_rotary_pos_emb`` dispatches
    to): rotates q and k in place in their ``[b, s, heads, d]`` storage and returns them, saving only cos and sin;
    backward rotates the incoming gradients in place the same way."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        q, k, cos, sin = _rope_layout(q, k, cos, sin, unsqueeze_dim)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None, None, None, None


def chunk_rows(tokens: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> int:
    """Rows of one logits chunk in ``fused_linear_cross_entropy_forward``: the transient logits are bounded to about
    ``tokens x hidden`` elements, ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))`` rows, at most ``tokens``."""
    inc_factor = -(-vocab // (chunk_mem_const * hidden))
    rows = -(-tokens // inc_factor)
    return min(1 << (rows - 1).bit_length(), tokens)


def _autocast_dtype() -> Any:
    """The autocast dtype in effect (the trace's CPU autocast stands for CUDA's), or None without autocast."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _can_use_mm_out(_input, weight) -> bool:
    """``_can_use_mm_out`` on CUDA: grad mode is off inside ``forward``, so ``torch.mm(out=)`` is used when the input
    and weight share a 16/32-bit dtype that autocast (if on) would compute in anyway."""
    if _input.dtype != weight.dtype or _input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    autocast = _autocast_dtype()
    return autocast is None or _input.dtype == autocast


def _add_weight_grad(grad_weight, grad_logits, input_chunk) -> None:
    """One chunk added into the weight gradient, by what each of Liger's three paths allocates (CUDA, capability
    >= 8): ``addmm(out=grad_weight)`` (with ``out_dtype=fp32`` for an fp32 accumulator, torch >= 2.8) allocates only
    the input chunk cast to the gradient's dtype; the legacy path a ``[vocab, hidden]`` product and its fp32 copy."""
    low = (torch.float16, torch.bfloat16)
    fp32_out = grad_weight.dtype == torch.float32 and torch.__version__ >= (2, 8)  # TorchVersion compares as versions
    if grad_logits.dtype in low and (fp32_out or grad_weight.dtype == grad_logits.dtype):
        cast = input_chunk.to(grad_logits.dtype) if input_chunk.dtype != grad_logits.dtype else input_chunk
        del cast
        return
    grad_weight += torch.mm(grad_logits.t(), input_chunk).float()


def _chunk(state: dict, start: int, end: int) -> None:
    """One chunk of ``fused_linear_cross_entropy_forward``'s loop (``ce_impl=None``: Liger's Triton cross-entropy
    kernel writes the chunk's loss into ``loss_1d`` and the logits' gradient over the logits)."""
    _input, weight, storage = state["input"], state["weight"], state["logits_storage"]
    input_chunk = _input[start:end]
    if storage is not None:
        logits = storage[: end - start]  # torch.mm(..., out=logits_chunk): in place
    else:
        logits = input_chunk @ weight.t()  # under autocast: the weight's transpose cast again (a view: not cached)
        if state["bias"] is not None:
            logits = logits + state["bias"]
    grad_logits = logits.contiguous()
    del logits
    if not state["input_grad"]:
        return
    if not (storage is not None and grad_logits.dtype == state["grad_input"].dtype):  # else mm(out=grad_input[...])
        state["grad_input"][start:end] = grad_logits @ weight
    if state["grad_weight"] is not None:
        _add_weight_grad(state["grad_weight"], grad_logits, input_chunk)
    if state["grad_bias"] is not None:
        state["grad_bias"].add_(grad_logits.sum(dim=0))


def _zeros_like(t, wanted: bool):
    return torch.zeros_like(t) if t is not None and wanted else None


def _detached(t):
    return t.detach() if t is not None else None


class FakeFusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``LigerFusedLinearCrossEntropyFunction`` (ops/fused_linear_cross_entropy.py) for the loss the models' LCE
    forwards ask for: ``reduction`` mean or sum, no class weights, z-loss, token scaling or accuracy outputs,
    ``accum_dtype=None``, ``chunk_mem_const=1``.

    Forward computes the loss and both gradients chunk by chunk, never the ``[tokens, vocab]`` logits: it allocates
    ``grad_input`` like the input, ``grad_weight`` like the weight (when it trains), an fp32 ``loss_1d``, the ignore
    mask, and per chunk the ``[rows, vocab]`` logits (one reused buffer when ``mm(out=)`` applies) with the matmuls'
    autocast casts; it saves ``grad_input`` and ``grad_weight``. Backward scales them in place and returns them."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias=None, ignore_index=-100, reduction="mean", softcap=None):
        tokens, hidden = _input.shape
        rows = chunk_rows(tokens, hidden, weight.shape[0])
        input_grad = _input.requires_grad
        grad_input = torch.zeros_like(_input)
        state = {
            "input": _input, "weight": weight, "bias": bias, "input_grad": input_grad, "grad_input": grad_input,
            "grad_weight": _zeros_like(weight, input_grad and weight.requires_grad),
            "grad_bias": _zeros_like(bias, input_grad),
        }  # fmt: skip
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=_input.device)
        target_mask = target != ignore_index  # noqa: F841  (alive to the end of the forward, as in Liger)
        non_ignored = target_mask.sum()  # total_n_non_ignore = target_mask.sum().item()
        del non_ignored
        use_mm_out = _can_use_mm_out(_input, weight)
        same = bias is None or bias.dtype == _input.dtype
        state["logits_storage"] = (
            torch.empty((rows, weight.shape[0]), dtype=_input.dtype, device=_input.device)
            if use_mm_out and same
            else None
        )
        for start in range(0, tokens, rows):
            _chunk(state, start, min(start + rows, tokens))
        del state["logits_storage"]
        loss = torch.sum(loss_1d)
        grad_weight, grad_bias = state.pop("grad_weight"), state.pop("grad_bias")
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        ctx.save_for_backward(grad_input.detach(), *(_detached(g) for g in (grad_weight, grad_bias)))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        # torch.equal(grad_output, torch.tensor(1.0)); when they differ, element_mul_kernel scales in place
        one = torch.tensor(1.0, device=grad_output.device)
        del one
        return grad_input, grad_weight, None, grad_bias, None, None, None
