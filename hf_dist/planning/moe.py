"""How a mixture-of-experts model routes its tokens and what its attention holds, read from its config: the facts the
activation terms (:mod:`hf_dist.planning.activations`) need beyond a Llama-style block.

Each fact names the transformers 5.24 code it was read from. The router differs by family: Mixtral keeps the top-k
weights in fp32 and always renormalises them (``modeling_mixtral.py MixtralTopKRouter.forward``); Qwen2-MoE (and
Qwen3-MoE, OLMoE, which share its router) cast them to the logits' dtype and renormalise only with ``norm_topk_prob``
(``modeling_qwen2_moe.py Qwen2MoeTopKRouter.forward``); DeepSeek-V2 runs the router linear on fp32 copies of its
input and weight and scales the fp32 weights by a constant (``modeling_deepseek_v2.py DeepseekV2TopkRouter.forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# routers whose top-k weights stay fp32 (the softmax is fp32 and nothing casts it back)
_FP32_WEIGHTS = ("mixtral", "deepseek_v2")
# routers that divide the top-k weights by their sum whatever the config says
_ALWAYS_RENORMALISE = ("mixtral",)
# routers whose linear runs on an fp32 copy of its input and weight
_FP32_ROUTER = ("deepseek_v2",)
# DeepSpeed 0.19.8's default ZeRO-3 leaf modules (runtime/zero/leaf_module_config.py DEFAULT_LEAF_MODULE_CLASSES, applied
# unless the config's zero_optimization.leaf_module says otherwise; hf_dist's JSON does not): transformers'
# MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock and Qwen3MoeSparseMoeBlock, by the model types that build them
ZERO3_LEAF_BLOCKS = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoeLayout:
    """One mixture-of-experts model's blocks beyond the routed experts (``ModelSpec.experts``/``experts_per_token``,
    whose width is ``ModelSpec.intermediate_size``).

    ``shared_size``: the SwiGLU width of the shared expert(s) every token also runs (Qwen2-MoE
    ``shared_expert_intermediate_size``; DeepSeek ``moe_intermediate_size * n_shared_experts``; 0: none);
    ``shared_gate``: the shared output is scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE);
    ``dense_layers``/``dense_size``: decoder layers with a dense SwiGLU instead (DeepSeek ``first_k_dense_replace``,
    Qwen2-MoE ``mlp_only_layers`` / ``decoder_sparse_step``) and its width;
    ``weights_fp32``: the top-k routing weights stay fp32 (else the compute dtype);
    ``renormalises``: the top-k weights are divided by their sum (in place: the division saves both);
    ``fp32_router``: the router linear runs on fp32 copies of its input and weight;
    ``aux_logits``: ``output_router_logits``: the load-balancing loss reads every layer's router logits.
    """

    shared_size: int = 0
    shared_gate: bool = False
    dense_layers: int = 0
    dense_size: int = 0
    weights_fp32: bool = True
    renormalises: bool = True
    fp32_router: bool = False
    aux_logits: bool = False


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek-V2/V3's multi-head latent attention (``modeling_deepseek_v2.py DeepseekV2Attention``): queries through
    ``q_lora_rank`` (None: one ``q_proj``), keys and values through a ``kv_lora_rank`` latent, per head a
    ``qk_nope + qk_rope`` wide query/key and a ``v_head_dim`` wide value."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope + self.qk_rope


def zero3_leaf_block_params(spec) -> int:
    """Parameters of one MoE block that DeepSpeed's ZeRO-3 runs as a leaf module (0 for a model whose block is not
    one): its router (E x h), its routed experts (gate, up and down: 3 x E x h x I) and its shared expert with its
    sigmoid gate (Qwen2-MoE), all fetched, released and reduced as one module
    (``partitioned_param_coordinator.py`` ``iter_params(module, recurse=z3_leaf_module(module))``; ``stage3.py``
    ``create_reduce_and_remove_grad_hooks``)."""
    if not spec.experts or spec.model_type not in ZERO3_LEAF_BLOCKS:
        return 0
    moe = spec.moe or MoeLayout()
    h = spec.hidden_size
    shared = 3 * h * moe.shared_size + (h if moe.shared_gate else 0)
    return spec.experts * h + 3 * spec.experts * h * spec.intermediate_size + shared


def moe_layout(text: Any, model_type: str | None, num_layers: int) -> MoeLayout:
    """The :class:`MoeLayout` of an MoE text config (``text``: the config's text part)."""
    moe_size = int(getattr(text, "moe_intermediate_size", 0) or 0)
    shared = int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
    if not shared and getattr(text, "n_shared_experts", None):
        shared = moe_size * int(text.n_shared_experts)
    return MoeLayout(
        shared_size=shared,
        shared_gate=model_type == "qwen2_moe" and shared > 0,
        dense_layers=_dense_layers(text, num_layers),
        dense_size=int(getattr(text, "intermediate_size", 0) or 0),
        weights_fp32=model_type in _FP32_WEIGHTS,
        renormalises=model_type in _ALWAYS_RENORMALISE or bool(getattr(text, "norm_topk_prob", False)),
        fp32_router=model_type in _FP32_ROUTER,
        aux_logits=bool(getattr(text, "output_router_logits", False)),
    )


def _dense_layers(text: Any, num_layers: int) -> int:
    """Decoder layers built with a dense feed-forward block: DeepSeek's first ``first_k_dense_replace``
    (``DeepseekV2DecoderLayer.__init__``), or Qwen2-MoE's ``mlp_only_layers`` and the layers off its
    ``decoder_sparse_step`` (``Qwen2MoeDecoderLayer.__init__``)."""
    first = getattr(text, "first_k_dense_replace", None)
    if first is not None:
        return min(int(first), num_layers)
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    only = set(getattr(text, "mlp_only_layers", None) or ())
    return sum(1 for i in range(num_layers) if i in only or (i + 1) % step)


def mla_shape(text: Any) -> MlaShape | None:
    """The :class:`MlaShape` of a config with latent attention (``kv_lora_rank``), else None."""
    if not getattr(text, "kv_lora_rank", None):
        return None
    q_rank = getattr(text, "q_lora_rank", None)
    return MlaShape(
        q_lora_rank=int(q_rank) if q_rank else None,
        kv_lora_rank=int(text.kv_lora_rank),
        qk_nope=int(text.qk_nope_head_dim),
        qk_rope=int(text.qk_rope_head_dim),
        v_head_dim=int(text.v_head_dim),
    )


def experts_code_as_modelled() -> bool:
    """Whether the installed transformers runs its experts as the 5.24 code the MoE terms were read from: one sort of
    the routed copies, each copy gathering its token's row (``integrations/moe.py grouped_mm_experts_forward``).
    Earlier 5.x argsort the copies, keep the inverse permutation and gather every token's rows first, and their
    model files route differently (DeepSeek-V2, Qwen2-MoE): there the MoE activation terms are an approximation
    (docs/measurements.md, "Mixtures of experts")."""
    import inspect

    try:
        from transformers.integrations.moe import grouped_mm_experts_forward
    except ImportError:
        return False
    return "torch.sort(expert_ids)" in inspect.getsource(grouped_mm_experts_forward)
