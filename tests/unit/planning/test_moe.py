"""Mixture-of-experts activation terms (issue 33, item 7): each against bytes computed by hand from transformers 5.24's
modelling code for a tiny config, and each block against what autograd really saves, listed tensor by tensor."""

from __future__ import annotations

import pytest
import torch

from hf_dist.planning.activations import (
    _latent_norm_bytes,
    activation_bytes,
    layer_activation_bytes,
    mla_attention_bytes,
    moe_block_bytes,
    moe_gradient_bytes,
    moe_layer_constant_bytes,
    routed_copy_bytes,
    router_bytes,
    router_logits_bytes,
    shared_expert_bytes,
)
from hf_dist.planning.dtypes import Dtypes
from hf_dist.planning.memory import fsdp_row_padding
from hf_dist.planning.model_source import config_from_dict
from hf_dist.planning.modelinfo import model_spec
from hf_dist.planning.moe import MlaShape, MoeLayout
from tests.unit.marks import moe_code_as_modelled

H, T = 32, 64
# FSDP2's bf16 units: weights gathered in bf16, compute and residual bf16, no autocast
BF16 = Dtypes(weights=4, master=0, grads=4, state=4, compute=2, residual=2, autocast=False)
TINY = {
    "mixtral": dict(model_type="mixtral", hidden_size=H, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128, num_local_experts=8,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=H, intermediate_size=80, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=128, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, num_experts=12, num_experts_per_tok=4),
    "deepseek_v2": dict(model_type="deepseek_v2", hidden_size=H, intermediate_size=80, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, vocab_size=128, kv_lora_rank=16,
                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        moe_intermediate_size=48, n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=6,
                        first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy"),
}  # fmt: skip


def spec(kind: str, **overrides):
    return model_spec(config_from_dict({**TINY[kind], **overrides}))


def test_the_configs_say_how_each_family_routes():
    mixtral, qwen, deepseek = spec("mixtral"), spec("qwen2_moe"), spec("deepseek_v2")
    assert mixtral.moe == MoeLayout(dense_size=48, weights_fp32=True, renormalises=True)
    assert qwen.moe == MoeLayout(shared_size=80, shared_gate=True, dense_size=80, weights_fp32=False,
                                 renormalises=False)  # fmt: skip
    assert spec("qwen2_moe", norm_topk_prob=True, output_router_logits=True).moe.renormalises
    assert deepseek.moe == MoeLayout(shared_size=2 * 48, dense_layers=1, dense_size=80, weights_fp32=True,
                                     renormalises=False, fp32_router=True)  # fmt: skip
    assert deepseek.mla == MlaShape(q_lora_rank=None, kv_lora_rank=16, qk_nope=16, qk_rope=8, v_head_dim=16)
    # Qwen2MoeDecoderLayer: dense where listed in mlp_only_layers or off decoder_sparse_step
    assert spec("qwen2_moe", num_hidden_layers=6, decoder_sparse_step=2).moe.dense_layers == 3
    assert spec("qwen2_moe", num_hidden_layers=6, mlp_only_layers=[0, 5]).moe.dense_layers == 2


def test_an_fsdp_unit_is_the_largest_layer_and_only_moe_layers_are_padded():
    deepseek = spec("deepseek_v2")  # layer 0 dense, layer 1 MoE
    experts = 16 * 3 * H * 48
    assert deepseek.layer_params > experts  # the MoE layer, not the dense first one
    # 16 experts over 32 ranks: each rank pads its shard to one whole expert, in the one MoE layer only
    assert fsdp_row_padding(deepseek, 32) == (3 * H * 48 - experts // 32, 16 * 3 * H * 48)


def test_router_bytes_by_hand():
    # Mixtral: fp32 softmax 4E, int64 top-k indices 8k, in-place renormalisation's top values 4k and sum 4
    assert router_bytes(spec("mixtral"), BF16, frozen=False) == 4 * 8 + 8 * 2 + 4 * 2 + 4
    # Qwen2-MoE without norm_topk_prob: softmax and indices only
    assert router_bytes(spec("qwen2_moe"), BF16, frozen=False) == 4 * 12 + 8 * 4
    # DeepSeek: its fp32 input copy (4h) when the router trains; a frozen router saves none
    deepseek = spec("deepseek_v2")
    assert router_bytes(deepseek, BF16, frozen=False) == 4 * 16 + 8 * 6 + 4 * H
    assert router_bytes(deepseek, BF16, frozen=True) == 4 * 16 + 8 * 6


def test_routed_copy_bytes_by_hand():
    # three int64 indices, gate_up output 2cI, silu output cI, down output ch, the routing weight; trained: + gathered
    # input ch and product cI
    i = 48
    assert routed_copy_bytes(spec("mixtral"), BF16, frozen=True) == 3 * 8 + 3 * 2 * i + 2 * H + 4
    assert routed_copy_bytes(spec("mixtral"), BF16, frozen=False) == 3 * 8 + 4 * 2 * i + 2 * 2 * H + 4
    assert routed_copy_bytes(spec("qwen2_moe"), BF16, frozen=False) == 3 * 8 + 4 * 2 * i + 2 * 2 * H + 2  # bf16 weight


def test_shared_expert_and_constant_bytes_by_hand():
    # Qwen2-MoE: SwiGLU of 80 (gate, silu, up, product) + the sigmoid gate's output and the shared output
    assert shared_expert_bytes(spec("qwen2_moe"), BF16, frozen=False) == 4 * 2 * 80 + 2 + 2 * H
    assert shared_expert_bytes(spec("qwen2_moe"), BF16, frozen=True) == 3 * 2 * 80 + 2 + 2 * H
    assert shared_expert_bytes(spec("mixtral"), BF16, frozen=False) == 0
    # grouped_mm's int32 offsets; DeepSeek's fp32 copy of its bf16 router weight
    assert moe_layer_constant_bytes(spec("mixtral"), BF16) == 4 * 8
    assert moe_layer_constant_bytes(spec("deepseek_v2"), BF16) == 4 * 16 + 4 * H * 16


def test_mla_attention_bytes_by_hand():
    deepseek = spec("deepseek_v2")  # 4 heads, qk 16 + 8, v 16, kv latent 16
    # kv_a_layernorm: fp32 copy 4r + rsqrt 4 (+ normalised and output 2 * 2r when it trains)
    assert _latent_norm_bytes(16, BF16, frozen=True) == 4 * 16 + 4
    assert _latent_norm_bytes(16, BF16, frozen=False) == 4 * 16 + 4 + 2 * 2 * 16
    # query and key 2 * c * a * 24, kv_b output c * a * (16 + 16), output c * a * 16, log-sum-exp 4a
    attention = 2 * (4 * 24 * 2 + 4 * 32 + 4 * 16) + 4 * 4
    assert mla_attention_bytes(deepseek, BF16, frozen=False) == attention + 4 * 16 + 4 + 2 * 2 * 16


def test_dense_layers_and_router_logits_add_up():
    deepseek = spec("deepseek_v2")
    dense = layer_activation_bytes(deepseek, T, 1, BF16, dense=True)
    moe = layer_activation_bytes(deepseek, T, 1, BF16)
    assert dense != moe
    assert activation_bytes(deepseek, T, 1, False, BF16) == (dense + moe, 0)
    assert activation_bytes(deepseek, T, 1, True, BF16)[1] == moe  # the recomputed layer is the largest
    # output_router_logits: the load-balancing loss keeps each MoE layer's softmax of its logits (compute dtype)
    qwen = spec("qwen2_moe", num_hidden_layers=3, output_router_logits=True)
    assert router_logits_bytes(qwen, T, 2, BF16) == 3 * 2 * 12 * T * 2
    assert router_logits_bytes(spec("qwen2_moe"), T, 2, BF16) == 0


def test_fsdp2_forward_copy_out_holds_three_padded_layers():
    """The last layer's forward copy-out (torch ``FSDPParamGroup.wait_for_unshard``): the earlier layers' activations
    and three gathered bf16 layers, each with FSDP2's padded expert rows and the layer's LoRA adapters."""
    from hf_dist.planning.memory import estimate_memory

    mixtral = spec("mixtral", num_hidden_layers=2)  # 8 experts over 16 ranks: each rank pads to one whole expert
    m = estimate_memory(mixtral, "fsdp_full_shard", 16, method="lora", seq_len=T, micro_batch_size=1)
    padded = (16 - 8) * 3 * H * 48
    adapters = 16 * ((32 + 32) + (32 + 16) + (32 + 16) + (32 + 32))  # rank 16 on q, k, v, o
    assert m.forward_gather == m.activations - m.last_layer + 3 * 2 * (mixtral.layer_params + padded + adapters)
    assert m.allocated >= m.params + m.optimizer + m.buffers - m.unit_buffers + m.forward_gather
    assert estimate_memory(mixtral, "ddp", 16, method="lora").forward_gather == 0


def test_lora_that_peft_moves_onto_the_experts_is_refused_by_name():
    """PEFT (``_convert_peft_config_moe``) turns DeepSeek-V2's gate/up/down_proj targets, and Mixtral's "all-linear",
    into LoRA on the stacked expert parameters, which hf_dist does not plan: refused, naming what moves."""
    from hf_dist.planning.lora import LoraSpec
    from hf_dist.planning.memory import estimate_memory

    pytest.importorskip("peft.utils.transformers_weight_conversion")
    with pytest.raises(ValueError, match=r"deepseek_v2 model: PEFT moves \['down_proj', 'gate_proj', 'up_proj'\]"):
        estimate_memory(spec("deepseek_v2"), "fsdp_full_shard", 2, method="lora")
    with pytest.raises(ValueError, match=r"mixtral model: PEFT moves \['gate', 'w1', 'w2', 'w3'\]"):
        estimate_memory(spec("mixtral"), "fsdp_full_shard", 2, method="lora", lora=LoraSpec(targets="all-linear"))
    attention = LoraSpec(targets=("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
    assert estimate_memory(spec("deepseek_v2"), "fsdp_full_shard", 2, method="lora", lora=attention).activations
    assert estimate_memory(spec("mixtral"), "fsdp_full_shard", 2, method="lora").activations  # q/k/v/o: kept


def _saved_bytes(kind: str, frozen: bool, part: str) -> int:
    """Bytes autograd saves in the tiny ``kind`` model's last layer's ``part`` (``mlp`` or ``self_attn``), built and
    run on fake bf16 tensors (FSDP2's gathered units; the tracer's grouped_mm path and CUDA attention): every saved
    tensor's storage once; parameters, the input and RoPE's complex ``freqs_cis`` (one for all layers) left out."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from hf_dist.tracing.cuda_attention import cuda_attention

    saved = {}

    def pack(t):
        if not t.is_complex():
            saved.setdefault(t.untyped_storage()._cdata, t.untyped_storage().nbytes())
        return t

    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config_from_dict(dict(TINY[kind])))
        for param in model.parameters():  # bf16 like FSDP2's gathered units (the router weight too)
            param.data = param.data.to(torch.bfloat16)
        model.requires_grad_(not frozen)
        module = getattr(model.model.layers[-1], part)
        x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
        kwargs = {}
        if part == "self_attn":
            kwargs = dict(attention_mask=None, position_embeddings=model.model.rotary_emb(x, torch.arange(T)[None]))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cuda_attention():
            module(x, **kwargs)
        left_out = {p.untyped_storage()._cdata for p in model.parameters()} | {x.untyped_storage()._cdata}
    return sum(n for key, n in saved.items() if key not in left_out)


@moe_code_as_modelled
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("kind", sorted(TINY))
def test_each_moe_block_saves_what_the_model_says(kind, frozen):
    """The MoE block of the tiny model's last layer: its saved tensors, listed from autograd, are the modelled bytes
    to the byte (the router's fp32 weight copy and grouped_mm's int32 offsets included: not parameters)."""
    modelled = moe_block_bytes(spec(kind), BF16, frozen) * T + moe_layer_constant_bytes(spec(kind), BF16)
    assert _saved_bytes(kind, frozen, "mlp") == modelled


@pytest.mark.parametrize("frozen", [False, True])
def test_latent_attention_saves_what_the_model_says(frozen):
    """DeepSeek-V2's attention with CUDA's efficient kernel (hf_dist.tracing.cuda_attention): query, key, kv_b's
    output (the value's storage), output, log-sum-exp and the latent norm; nothing per key."""
    philox = 2 * 8  # the efficient kernel's 0-d seed and offset, saved for backward
    modelled = mla_attention_bytes(spec("deepseek_v2"), BF16, frozen) * T + philox
    assert _saved_bytes("deepseek_v2", frozen, "self_attn") == modelled


def test_moe_gradient_bytes_by_hand():
    # Mixtral (fp32 routing weights): un-permuting holds 3 fp32 S x h tensors and the down gradient's cast, less inv_perm
    assert moe_gradient_bytes(spec("mixtral"), BF16, frozen=True) == 2 * (3 * 4 * H + 2 * H - 8)
    # Qwen2-MoE (bf16 weights), frozen: the experts' SwiGLU moment 3cI - ch - 8 is larger; its gate adds ch - c
    assert moe_gradient_bytes(spec("qwen2_moe"), BF16, frozen=True) == 4 * (3 * 2 * 48 - 2 * H - 8) + 2 * H - 2
    # DeepSeek: the shared experts' backward runs first and frees their saved tensors, keeping their input gradient
    routed = 6 * (3 * 4 * H + 2 * H - 8)
    assert moe_gradient_bytes(spec("deepseek_v2"), BF16, frozen=False) == routed - 4 * 2 * 96 + 2 * H


class _Live:
    """Live bytes of every storage the ops under it create (parameters and their gradients left out), and the peak."""

    def __init__(self, skip_shapes):
        from torch.utils._python_dispatch import TorchDispatchMode

        live = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                live.add(out)
                return out

        self.mode, self.skip, self.refs, self.peak, self.tracking = Mode(), skip_shapes, {}, 0, False

    def add(self, out):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in self.skip:
                storage = t.untyped_storage()
                self.refs.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        if self.tracking:
            self.peak = max(self.peak, self.now())

    def now(self) -> int:
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())


@moe_code_as_modelled
@pytest.mark.parametrize("inter", [48, 160])  # the un-permuting moment is the larger at 48, the experts' at 160
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("kind", sorted(TINY))
def test_each_moe_backward_peaks_where_the_model_says(kind, frozen, inter):
    """A tiny MoE block's backward on fake bf16 tensors: the most it holds above what was live when backward began
    (its saved tensors, input, output and incoming gradient) is :func:`moe_gradient_bytes`, to the byte."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    width = "intermediate_size" if kind == "mixtral" else "moe_intermediate_size"
    config = config_from_dict({**TINY[kind], width: inter})
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config)
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
        model.requires_grad_(not frozen)
        block = model.model.layers[-1].mlp
        shapes = {tuple(p.shape) for p in block.parameters()}
        live = _Live(shapes | {s[:-2] + (s[-1], s[-2]) for s in shapes if len(s) > 1})  # weight gradients too
        x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
        with live.mode:
            out = block(x)
            grad = torch.randn_like(out)
            start, live.tracking = live.now(), True
            out.backward(grad)
    assert live.peak - start == moe_gradient_bytes(model_spec(config), BF16, frozen) * T
