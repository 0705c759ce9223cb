"""Liger traced: the fake functions save and allocate what liger-kernel 0.8.5's Triton functions do (expected sets
written out from its source, ``liger_kernel/ops/*.py``, for tiny shapes), the model is patched as the Trainer's Liger
patch does, and a Liger layout traces; another liger-kernel release is refused, never traced as 0.8.5."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from hf_dist.embedded.model import tiny_llama_config
from hf_dist.tracing import TraceUnsupported, trace_memory
from hf_dist.tracing.liger import LIGER_VERSION, liger_applied, version
from hf_dist.tracing.liger.functions import (
    SM_COUNT,
    FakeFusedLinearCrossEntropyFunction,
    FakeRMSNormFunction,
    FakeRopeFunction,
    FakeSiLUMulFunction,
    chunk_rows,
)

B, S, H, I, V = 2, 8, 16, 24, 100  # noqa: E741  (batch, sequence, hidden, intermediate, vocabulary)
BF16, FP32 = torch.bfloat16, torch.float32


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def saved(out: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) if t is not None else None for t in out.grad_fn.saved_tensors]


# ---------------------------------------------------------------- each function against Liger 0.8.5's source


def test_rms_norm_saves_its_input_the_weight_and_an_fp32_rstd_per_row():
    """rms_norm_forward: Y = empty((rows, H), X.dtype), RSTD = empty(rows, fp32) (llama casting);
    save_for_backward(X viewed (rows, H), W, RSTD)."""
    x = torch.empty(B, S, H, dtype=BF16, requires_grad=True)
    w = torch.empty(H, dtype=FP32, requires_grad=True)
    y = FakeRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True, None)
    assert (tuple(y.shape), y.dtype) == ((B, S, H), BF16) and storage(y) != storage(x)
    assert saved(y) == [((B * S, H), BF16), ((H,), FP32), ((B * S,), FP32)]
    assert storage(y.grad_fn.saved_tensors[0]) == storage(x)  # the input itself, not a copy
    dy = torch.empty(B, S, H, dtype=BF16)
    dx, dw = y.grad_fn.apply(dy)[:2]
    assert storage(dx) == storage(dy)  # in_place=True: dX written into dY
    assert (tuple(dw.shape), dw.dtype) == ((H,), FP32)
    assert SM_COUNT == 132  # H100 SXM / H200 multiprocessors: the fp32 [SMs, H] partial of dW


def test_rms_norm_of_a_frozen_weight_has_no_weight_gradient_and_not_in_place_allocates_dx():
    x = torch.empty(B, S, H, dtype=BF16, requires_grad=True)
    y = FakeRMSNormFunction.apply(x, torch.empty(H, dtype=BF16), 1e-6, 0.0, "llama", False, None)
    dy = torch.empty(B, S, H, dtype=BF16)
    dx, dw = y.grad_fn.apply(dy)[:2]
    assert dw is None and storage(dx) != storage(dy) and dx.shape == dy.shape


def test_swiglu_saves_gate_and_up_and_writes_their_gradients_into_them():
    """swiglu_forward: c = empty_like(a); save_for_backward(a, b) (2-d views); swiglu_backward writes da, db into
    a and b and returns them."""
    a = torch.empty(B, S, I, dtype=BF16, requires_grad=True)
    b = torch.empty(B, S, I, dtype=BF16, requires_grad=True)
    c = FakeSiLUMulFunction.apply(a, b, 1.0, 1.0)
    assert (tuple(c.shape), c.dtype) == ((B, S, I), BF16) and storage(c) not in (storage(a), storage(b))
    assert saved(c) == [((B * S, I), BF16), ((B * S, I), BF16)]
    da, db = c.grad_fn.apply(torch.empty(B, S, I, dtype=BF16))[:2]
    assert (storage(da), storage(db)) == (storage(a), storage(b)) and da.shape == a.shape


def test_rope_rotates_q_and_k_in_their_storage_and_saves_only_cos_and_sin():
    """rope_forward: q, k transposed back to [b, s, heads, d] (contiguous: no copy), rotated in place, returned
    transposed; save_for_backward(cos, sin) as 3-d."""
    heads, kv, d = 4, 2, 8
    q = torch.empty(B, S, heads, d, dtype=BF16, requires_grad=True).transpose(1, 2)  # HF: proj(x).view().transpose()
    k = torch.empty(B, S, kv, d, dtype=BF16, requires_grad=True).transpose(1, 2)
    cos, sin = torch.empty(1, S, d), torch.empty(1, S, d)
    q2, k2 = FakeRopeFunction.apply(q, k, cos, sin, None, 1, None)
    assert (q2.shape, k2.shape) == (q.shape, k.shape) and (storage(q2), storage(k2)) == (storage(q), storage(k))
    assert saved(q2) == [((1, S, d), FP32), ((1, S, d), FP32)]
    dq = torch.empty(B, S, heads, d, dtype=BF16).transpose(1, 2)  # sdpa's gradients: [b, s, heads, d] storage
    dk = torch.empty(B, S, kv, d, dtype=BF16).transpose(1, 2)
    gq, gk = q2.grad_fn.apply(dq, dk)[:2]
    assert (storage(gq), storage(gk)) == (storage(dq), storage(dk))


def test_chunk_rows_follow_liger():
    # fused_linear_cross_entropy.py's own example: BT = 4096*4, V = 32000, H = 4096 ==> chunk_size = 2048
    assert chunk_rows(4096 * 4, 4096, 32000) == 2048
    assert chunk_rows(B * S, H, V) == 4  # ceil(100 / 16) = 7 chunks' worth: ceil(16 / 7) = 3 -> next power of 2
    assert chunk_rows(3, 4096, 1000) == 3  # never more rows than tokens


def _flce_peak(x, w, autocast: bool) -> tuple[int, list]:
    """Peak bytes the fused linear cross-entropy's forward adds to its inputs, and what it saved."""
    target = torch.randint(0, V, (x.shape[0],))
    tracker = MemTracker()
    tracker.track_external(x, w, target)  # a view of an input would otherwise count its storage as new
    with tracker, torch.autocast("cpu", dtype=BF16, enabled=autocast):
        before = tracker.get_tracker_snapshot()
        loss = FakeFusedLinearCrossEntropyFunction.apply(x, w, target, None, -100, "mean", None)
        peak = tracker.get_tracker_snapshot("peak")
    base = sum(snap["Total"] for snap in before.values())
    return sum(snap["Total"] for snap in peak.values()) - base, saved(loss)


def test_fused_linear_cross_entropy_lora_head_reuses_one_logits_buffer():
    """A frozen bf16 head under bf16 autocast (LoRA): ``mm(out=)`` applies, so the forward holds grad_input
    (zeros_like input), loss_1d (fp32), the ignore mask (bool) and one [rows, V] logits buffer; no weight gradient;
    it saves grad_input only."""
    tokens = B * S
    x = torch.empty(tokens, H, dtype=BF16, requires_grad=True)
    w = torch.empty(V, H, dtype=BF16)
    peak, kept = _flce_peak(x, w, autocast=True)
    rows = chunk_rows(tokens, H, V)
    assert peak == 2 * tokens * H + 4 * tokens + tokens + 2 * rows * V
    assert kept == [((tokens, H), BF16), None, None]


def test_fused_linear_cross_entropy_fp32_head_under_autocast_computes_the_weight_gradient_in_forward():
    """Full fine-tuning with fp32 masters under bf16 autocast: grad_input and grad_weight in fp32, and per chunk the
    matmuls' casts: ``_input_chunk @ weight.t()`` casts the transposed weight anew (a view: autocast does not cache
    it), ``grad_logits @ weight`` caches one bf16 copy of the weight; ``addmm(out_dtype=fp32)`` needs only the
    chunk cast to bf16. The peak is the second chunk's logits matmul."""
    tokens = B * S
    x = torch.empty(tokens, H, dtype=FP32, requires_grad=True)
    w = torch.empty(V, H, dtype=FP32, requires_grad=True)
    peak, kept = _flce_peak(x, w, autocast=True)
    rows = chunk_rows(tokens, H, V)
    held = 4 * tokens * H + 4 * V * H + 4 * tokens + tokens  # grad_input, grad_weight, loss_1d, mask
    matmul = 2 * V * H + 2 * V * H + 2 * rows * H + 2 * rows * V  # cached weight, weight.t() cast, chunk cast, logits
    assert peak == held + matmul
    assert kept == [((tokens, H), FP32), ((V, H), FP32), None]


# ---------------------------------------------------------------- the model, patched as the Trainer patches it


def test_the_model_is_patched_as_apply_liger_kernel_to_llama_patches_it():
    from transformers.models.llama import modeling_llama

    from hf_dist.tracing.prepare import build_model
    from hf_dist.tracing.setup import TraceSetup

    original = modeling_llama.apply_rotary_pos_emb
    model = build_model(tiny_llama_config(), TraceSetup(strategy="ddp", method="lora"))
    with liger_applied(True, model.config) as apply:
        apply(model)
        assert modeling_llama.apply_rotary_pos_emb.__name__ == "fake_rotary_pos_emb"
    assert modeling_llama.apply_rotary_pos_emb is original  # restored after the trace
    base = model.get_base_model()
    assert base.forward.__func__.__name__ == "lce_forward"
    layer = base.model.layers[0]
    for norm in (base.model.norm, layer.input_layernorm, layer.post_attention_layernorm):
        assert norm.forward.__func__.__name__ == "_rms_norm_forward" and (norm.casting_mode, norm.in_place) == (
            "llama", True)  # fmt: skip
    assert layer.mlp.forward.__func__.__name__ == "_swiglu_forward"


def _allocations(liger: bool) -> list[tuple[int, ...]]:
    """Shapes of every tensor made by one forward and backward of the tiny Llama (fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_dist.tracing.prepare import build_model, materialize
    from hf_dist.tracing.setup import TraceSetup

    shapes: list[tuple[int, ...]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor))  # fmt: skip
            return out

    config = tiny_llama_config()
    model = build_model(config, TraceSetup(strategy="ddp", mixed_precision="no"))
    with liger_applied(liger, config) as apply, FakeTensorMode(allow_non_fake_inputs=True):
        model = materialize(apply(model))
        ids = torch.randint(0, config.vocab_size, (B, S))
        with Record():
            model(input_ids=ids, labels=ids).loss.backward()
    return shapes


def test_fused_linear_cross_entropy_never_materialises_the_logits():
    logits = (B, S, tiny_llama_config().vocab_size)
    flat = (B * S, tiny_llama_config().vocab_size)
    assert logits in _allocations(liger=False)
    with_liger = _allocations(liger=True)
    assert logits not in with_liger and flat not in with_liger
    assert (chunk_rows(B * S, 64, 256), 256) in with_liger  # one chunk of logits: 16 rows of 256


LONG = 128  # tokens enough that activations, not a layer's states at the optimizer step, make the peak


def _peak(layers: int, liger: bool) -> int:
    config = tiny_llama_config(num_hidden_layers=layers, vocab_size=2048)
    return trace_memory(config, isolate=False, strategy="ddp", seq_len=LONG, micro_batch_size=B,
                        use_liger_kernel=liger).peak_bytes  # fmt: skip


def test_each_liger_layer_saves_the_expected_bytes_less():
    """Per decoder layer and token, under bf16 autocast with fp32 masters (a layer's extra states cancel out):
    HF's RMSNorm saves its fp32 normalised tensor for the weight's multiply (4H bytes, twice a layer), Liger's only
    an fp32 rstd beside the input both keep; HF's SwiGLU saves silu(gate) (2I bytes), Liger's recomputes it. RoPE
    saves nothing per layer either way. The vocabulary is large enough that the peak is the loss in both."""
    per_layer_saving = B * LONG * (2 * 4 * 64 + 2 * 128)  # tiny_llama_config: H = 64, I = 128
    plain = _peak(2, liger=False) - _peak(1, liger=False)
    liger = _peak(2, liger=True) - _peak(1, liger=True)
    assert plain - liger == per_layer_saving


# ---------------------------------------------------------------- what is refused


def test_another_liger_release_is_refused_naming_both_versions(monkeypatch):
    monkeypatch.setattr(version, "installed_liger_version", lambda: "0.9.0")
    with pytest.raises(TraceUnsupported, match=rf"liger-kernel 0\.9\.0 is installed.*copy {LIGER_VERSION}") as info:
        trace_memory(tiny_llama_config(), strategy="ddp", use_liger_kernel=True)
    assert info.value.reason.endswith(f"install liger-kernel=={LIGER_VERSION} to trace")  # what to do
    monkeypatch.setattr(version, "installed_liger_version", lambda: LIGER_VERSION)
    assert trace_memory(tiny_llama_config(), isolate=False, strategy="ddp", seq_len=S, use_liger_kernel=True).complete
    monkeypatch.setattr(version, "installed_liger_version", lambda: None)  # not installed: hf_dist's copy of 0.8.5
    assert version.version_refusal() is None


def test_a_model_type_whose_liger_patch_is_not_copied_is_refused():
    from transformers import Gemma2Config

    gemma = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256)  # fmt: skip
    with pytest.raises(TraceUnsupported, match=r"Liger kernels on model_type 'gemma2'.*llama, mistral, qwen2"):
        trace_memory(gemma, strategy="ddp", use_liger_kernel=True)
    assert trace_memory(gemma, isolate=False, strategy="ddp", seq_len=S).complete  # without Liger it traces
