"""Llama, Mistral, Qwen2, Qwen3, Gemma 2, Mixtral and Qwen2-MoE described from config.json: no transformers or torch.

Importing transformers' config and modelling classes takes longer than a whole plan (issue 39: ``hf-dist plan`` on a
local config.json in seconds). For these seven families every module the meta model holds follows from the config,
so :func:`describe` counts them by arithmetic into the same :class:`Counts` the meta model gives
(:func:`hf_dist.planning.modelinfo.spec_from_config`). ``tests/unit/planning/test_families.py`` builds both for each
family, with and without biases, ties and explicit head sizes, and compares every field on the installed
transformers.

Only a config this file models exactly is described: a known ``model_type`` and causal-LM architecture, every key
one the family's config class takes with a value of the type it expects, RoPE unscaled or scaled in a way that only
changes positions. Anything else (another family, remote code, a quantisation config, a key not listed here) returns
None and is built on the meta device, with transformers' own checks, as before. What changed between the tested
transformers releases (Gemma 2's attention, each family's tensor-parallel plan) is read from the installed
transformers' source without importing it (:mod:`hf_dist.planning.installed_source`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from numbers import Real
from typing import Any, NamedTuple

from hf_dist.planning.installed_source import UNREAD, class_literal
from hf_dist.planning.lora import DEFAULT_TARGETS
from hf_dist.planning.tensor_split import TensorSplit, split_by_plan


class Module(NamedTuple):
    """One module of a model as PEFT matches it: its name (``target_modules`` / ``modules_to_save`` keys; relative to
    a decoder layer for the layers' own modules), its kind (``linear``: ``nn.Linear`` or transformers' ``Conv1D``,
    ``embedding``, ``other``), its parameters (children included) and, for a linear, its features and bias."""

    name: str
    kind: str
    params: int
    in_features: int = 0
    out_features: int = 0
    bias: bool = False


class Inventory(NamedTuple):
    """Every module PEFT could adapt or save: the decoder layers' ModuleList name, one layer's modules (relative
    names), the modules outside the layers, the input and output embeddings' names, the params named ``bias``."""

    layer_prefix: str
    layer_modules: tuple[Module, ...]
    outer_modules: tuple[Module, ...]
    input_module: str
    output_module: str
    bias_params: int


class Counts(NamedTuple):
    """What counting a model's modules tells the planner."""

    total: int  # params, tied embeddings once, adapters excluded
    layer: int  # params of one decoder layer (the largest)
    embedding: int  # input embedding params
    norms: int  # normalisation modules per layer
    lora_linears: tuple[tuple[str, int, int], ...]  # (name, in, out) of the layer's LoRA-targetable linears
    attention: str  # "sdpa", or "eager" when the model class does not support sdpa (``_supports_sdpa``)
    inventory: Inventory
    tensor_split: TensorSplit | None = None  # what the model's tensor-parallel plan splits (None: it has none)


class ConfigFields(types.SimpleNamespace):
    """A config.json's fields, its family's defaults filled in, read as attributes the way a transformers config is.
    ``source`` is the dict it was read from: :func:`hf_dist.planning.model_source.resolve_config` builds the
    transformers config from it where one is needed (a trace, FSDP's wrap classes)."""

    source: dict


@dataclass(frozen=True)
class Family:
    """A decoder family: its causal LM's class name and its config class's defaults for the keys that shape it."""

    causal_lm: str
    defaults: dict[str, Any]
    nullable: frozenset[str] = frozenset()  # keys whose value may be null (transformers 5's validators refuse others)
    qkv_bias: bool | str = "attention_bias"  # q/k/v projections carry a bias, or the config key that says
    qk_norm: bool = False  # queries and keys are normalised per head (Qwen3's q_norm / k_norm)
    activation: tuple[str, str] = ("hidden_act", "silu")  # the key naming the MLP's activation, and the one modelled
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # a decoder layer's own norms
    inert: frozenset[str] = frozenset()  # keys hub files of the family carry that its config class does not take
    # (transformers' modelling file, its pretrained class) whose ``_supports_sdpa`` changed between the tested
    # transformers releases; None: sdpa in all of them
    sdpa_from: tuple[str, str] | None = None
    null_head_dim: bool = False  # the config keeps a null head_dim (transformers' dynamic RoPE then fails on it)
    mlp: str = "dense"  # the feed-forward block (:data:`_MLPS`): a SwiGLU, or a mixture of experts' sparse block


_LLAMA_STYLE = dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    tie_word_embeddings=False, hidden_act="silu")  # fmt: skip
# Qwen2's and Qwen3's shared defaults (a null num_key_value_heads means as many as the heads)
_QWEN_STYLE = dict(_LLAMA_STYLE, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32,
                   max_position_embeddings=32768, sliding_window=None, use_sliding_window=False,
                   max_window_layers=28)  # fmt: skip
FAMILIES = {
    "llama": Family(
        "LlamaForCausalLM",
        dict(
            _LLAMA_STYLE,
            intermediate_size=11008,
            num_key_value_heads=None,
            max_position_embeddings=2048,
            attention_bias=False,
            mlp_bias=False,
            head_dim=None,
            pretraining_tp=1,
        ),
        frozenset({"num_key_value_heads", "head_dim"}),
    ),
    "mistral": Family(
        "MistralForCausalLM",
        dict(
            _LLAMA_STYLE,
            intermediate_size=14336,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            head_dim=None,
            sliding_window=4096,
        ),
        frozenset({"head_dim", "sliding_window"}),
        qkv_bias=False,
    ),
    "qwen2": Family(
        "Qwen2ForCausalLM",
        _QWEN_STYLE,
        frozenset({"num_key_value_heads", "sliding_window"}),
        qkv_bias=True,
    ),
    "qwen3": Family(
        "Qwen3ForCausalLM",
        dict(_QWEN_STYLE, attention_bias=False, head_dim=128),  # Qwen3's own head size, whatever the hidden size
        frozenset({"sliding_window"}),
        qk_norm=True,
    ),
    "gemma2": Family(
        "Gemma2ForCausalLM",
        dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
             tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
             final_logit_softcapping=30.0, attn_logit_softcapping=50.0, use_bidirectional_attention=None),
        frozenset({"sliding_window", "final_logit_softcapping", "attn_logit_softcapping",
                   "use_bidirectional_attention"}),
        activation=("hidden_activation", "gelu_pytorch_tanh"),
        norms=("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"),
        inert=frozenset({"hidden_act", "cache_implementation", "sliding_window_size"}),
        # sdpa cannot soft-cap scores: transformers 5.0 runs Gemma 2 under it, 5.24 only eager
        sdpa_from=("models/gemma2/modeling_gemma2.py", "Gemma2PreTrainedModel"),
    ),
    "mixtral": Family(
        "MixtralForCausalLM",
        dict(_LLAMA_STYLE, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072,
             head_dim=None, sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
             output_router_logits=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0),
        frozenset({"head_dim", "sliding_window"}),
        qkv_bias=False,
        null_head_dim=True,
        mlp="mixtral",
    ),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM",
        dict(_QWEN_STYLE, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=16, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=1408,
             shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60, norm_topk_prob=False,
             output_router_logits=False, router_aux_loss_coef=0.001, mlp_only_layers=None, qkv_bias=True),
        frozenset({"sliding_window", "mlp_only_layers"}),
        qkv_bias="qkv_bias",
        mlp="qwen2_moe",
    ),
}  # fmt: skip
_NONE = type(None)
_SIZE = "a positive int"
_INTS = "a list of ints"
# the type transformers takes for each key a family above reads (_SIZE: a positive int); keys outside a family's
# defaults and outside _ANY_FAMILY are not modelled
_TYPES = {
    "vocab_size": _SIZE, "hidden_size": _SIZE, "intermediate_size": _SIZE, "num_hidden_layers": _SIZE,
    "num_attention_heads": _SIZE, "num_key_value_heads": (_SIZE, _NONE), "head_dim": (_SIZE, _NONE),
    "max_position_embeddings": _SIZE, "tie_word_embeddings": bool, "hidden_act": str, "attention_bias": bool,
    "mlp_bias": bool, "pretraining_tp": _SIZE, "sliding_window": (_SIZE, _NONE), "use_sliding_window": bool,
    "max_window_layers": _SIZE, "hidden_activation": str, "query_pre_attn_scalar": _SIZE,
    "final_logit_softcapping": (float, _NONE), "attn_logit_softcapping": (float, _NONE),
    "use_bidirectional_attention": (bool, _NONE), "cache_implementation": str, "sliding_window_size": _SIZE,
    "num_local_experts": _SIZE, "num_experts_per_tok": _SIZE, "output_router_logits": bool,
    "router_aux_loss_coef": float, "router_jitter_noise": float, "decoder_sparse_step": _SIZE,
    "moe_intermediate_size": _SIZE, "shared_expert_intermediate_size": _SIZE, "num_experts": _SIZE,
    "norm_topk_prob": bool, "mlp_only_layers": (_INTS, _NONE), "qkv_bias": bool,
    # keys every family takes that change no module and no shape
    "model_type": str, "architectures": list, "transformers_version": str, "torch_dtype": (str, _NONE),
    "dtype": (str, _NONE), "attention_dropout": float, "initializer_range": float, "rms_norm_eps": float,
    "rope_theta": float, "use_cache": bool, "bos_token_id": (int, _NONE), "eos_token_id": (int, list, _NONE),
    "pad_token_id": (int, _NONE), "rope_scaling": (dict, _NONE), "rope_parameters": (dict, _NONE),
}  # fmt: skip
_ANY_FAMILY = ("model_type", "architectures", "transformers_version", "torch_dtype", "dtype", "attention_dropout",
               "initializer_range", "rms_norm_eps", "rope_theta", "use_cache", "bos_token_id", "eos_token_id",
               "pad_token_id", "rope_scaling", "rope_parameters")  # fmt: skip
_DTYPES = (None, "float32", "bfloat16", "float16")
# RoPE scalings transformers builds from these keys alone; they change positions, never a module
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


def describe(data: dict, name: str | None = None) -> tuple[ConfigFields, Counts] | None:
    """(the config's fields, family defaults filled in, as an attribute view; its :class:`Counts`) for a config of a
    family above that this file models exactly, else None (build it on the meta device)."""
    family = FAMILIES.get(data.get("model_type"))
    if family is None or not _modelled(data, family):
        return None
    attention, plan = _attention(family), _tp_plan(data["model_type"], family)
    if attention is None or plan is UNREAD:
        return None  # transformers is not installed, or its class does not say plainly: the meta model tells
    # the plan is copied: class_literal's read is cached and shared
    fields = {**family.defaults, **data, "_name_or_path": name or "", "base_model_tp_plan": dict(plan)}
    view = ConfigFields(**fields, source=dict(data))
    view.num_key_value_heads = view.num_key_value_heads or view.num_attention_heads
    view.dtype = data.get("dtype", data.get("torch_dtype"))
    if view.num_attention_heads % view.num_key_value_heads or view.hidden_size % view.num_attention_heads:
        return None  # refused by check_dimensions, or by transformers 5.24's LlamaConfig even with a head_dim
    if getattr(view, "head_dim", None) is None:
        view.head_dim = view.hidden_size // view.num_attention_heads
    return view, _counts(view, family, attention)


def _modelled(data: dict, family: Family) -> bool:
    """Whether every key of ``data`` is one this file models, with a value of the type transformers takes."""
    known = all(key in family.defaults or key in _ANY_FAMILY or key in family.inert for key in data)
    act_key, activation = family.activation
    return (
        known
        and all(_typed(value, _TYPES[key]) for key, value in data.items())
        and all(data[key] is not None for key in family.defaults if key in data and key not in family.nullable)
        and data.get("architectures", [family.causal_lm]) == [family.causal_lm]
        and all(data.get(name, activation) == activation for name in {act_key, "hidden_act"})
        and data.get("dtype", data.get("torch_dtype")) in _DTYPES
        and all(_plain_rope(data.get(key)) for key in ("rope_scaling", "rope_parameters"))
        and not (family.null_head_dim and {**family.defaults, **data}["head_dim"] is None and _dynamic_rope(data))
    )


def _typed(value: Any, types_: Any) -> bool:
    """``value`` is one of ``types_`` (:data:`_SIZE`: a positive int; never a bool unless bool is asked for)."""
    for kind in types_ if isinstance(types_, tuple) else (types_,):
        if kind == _SIZE:
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return True
        elif kind == _INTS:
            if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return True
        elif kind is float:  # transformers 5.24's validators refuse an int where a float is declared
            if isinstance(value, float):
                return True
        elif isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return True
    return False


def _dynamic_rope(data: dict) -> bool:
    """Whether the config scales RoPE dynamically (``_compute_dynamic_ntk_parameters`` reads ``head_dim`` with no
    fallback for null, in transformers 5.0 and 5.24 alike)."""
    params = [data.get(key) or {} for key in ("rope_scaling", "rope_parameters")]
    return any(p.get("rope_type", p.get("type")) == "dynamic" for p in params)


def _plain_rope(params: dict | None) -> bool:
    """True for no RoPE parameters, or a scaling listed in :data:`_ROPE_KEYS` with exactly its keys, all numbers."""
    if params is None:
        return True
    kind = params.get("rope_type", params.get("type", "default"))
    values = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")}
    numbers = all(isinstance(v, Real) and not isinstance(v, bool) for v in values.values())
    return kind in _ROPE_KEYS and set(values) == _ROPE_KEYS[kind] and numbers


def _attention(family: Family) -> str | None:
    """``"sdpa"``, or ``"eager"`` where the installed transformers' model class does not support sdpa (its own
    ``_supports_sdpa``: PreTrainedModel's default, False, when the class does not set it); None when unread."""
    if family.sdpa_from is None:
        return "sdpa"
    supports = class_literal(*family.sdpa_from, "_supports_sdpa", ("PreTrainedModel",), False)
    return ("sdpa" if supports else "eager") if isinstance(supports, bool) else None


def _tp_plan(model_type: str, family: Family) -> Any:
    """The installed transformers' ``base_model_tp_plan`` of the family's config class (it differs between the
    tested releases for the mixtures of experts), or :data:`UNREAD`."""
    config_class = family.causal_lm.removesuffix("ForCausalLM") + "Config"
    module_file = f"models/{model_type}/configuration_{model_type}.py"
    plan = class_literal(
        module_file, config_class, "base_model_tp_plan", ("PreTrainedConfig", "PretrainedConfig"), None
    )
    return plan if isinstance(plan, dict) and all(isinstance(v, str) for v in plan.values()) else UNREAD


def _linear(name: str, in_features: int, out_features: int, bias: bool) -> Module:
    return Module(name, "linear", in_features * out_features + (out_features if bias else 0), in_features,
                  out_features, bias)  # fmt: skip


def _counts(v: Any, family: Family, implementation: str) -> Counts:
    """The modules transformers' Llama-style decoder builds from ``v``, counted as the meta model would be: every
    layer (an MoE's may differ), the largest describing them all, and what the installed plan splits in each."""
    hidden = v.hidden_size
    layers = [_layer(v, family, i) for i in range(v.num_hidden_layers)]
    sizes = [sum(size for _, size in weights) for _, weights in layers]
    index = max(range(len(sizes)), key=sizes.__getitem__)  # the largest layer describes them all, as on meta
    modules = layers[index][0]
    embedding = v.vocab_size * hidden
    outer = (Module("model.embed_tokens", "embedding", embedding, v.vocab_size, hidden),
             Module("model.norm", "other", hidden), Module("model.rotary_emb", "other", 0),
             _linear("lm_head", hidden, v.vocab_size, False))  # fmt: skip
    biases = sum(size for _, weights in layers for name, size in weights if name.endswith(".bias"))
    inventory = Inventory("model.layers", modules, outer, "model.embed_tokens", "lm_head", biases)
    total = embedding * (1 if v.tie_word_embeddings else 2) + sum(sizes) + hidden
    # the model's plan (transformers' ``model.tp_plan``) is the config's under the base model's prefix
    plan = {f"model.{key}": style for key, style in v.base_model_tp_plan.items()}
    split = split_by_plan([weights for _, weights in layers], "model.layers", plan, index)
    targets = [m for m in modules if m.kind == "linear" and m.name.rsplit(".", 1)[-1] in DEFAULT_TARGETS]
    return Counts(total, sizes[index], embedding, len(family.norms) + 2 * family.qk_norm,
                  tuple((m.name.rsplit(".", 1)[-1], m.in_features, m.out_features) for m in targets), implementation,
                  inventory, split)  # fmt: skip


Block = tuple[tuple[Module, ...], list[tuple[str, int]]]  # modules (named_modules' order), parameters (name, size)


def _layer(v: Any, family: Family, index: int) -> Block:
    """Decoder layer ``index``: its modules as PEFT sees them and its parameters."""
    hidden, q_out, kv_out = v.hidden_size, v.num_attention_heads * v.head_dim, v.num_key_value_heads * v.head_dim
    qkv_bias = family.qkv_bias if isinstance(family.qkv_bias, bool) else getattr(v, family.qkv_bias, False)
    attention = (_linear("self_attn.q_proj", hidden, q_out, qkv_bias), _linear("self_attn.k_proj", hidden, kv_out,
                 qkv_bias), _linear("self_attn.v_proj", hidden, kv_out, qkv_bias),
                 _linear("self_attn.o_proj", q_out, hidden, getattr(v, "attention_bias", False)))  # fmt: skip
    per_head = (Module("self_attn.q_norm", "other", v.head_dim), Module("self_attn.k_norm", "other", v.head_dim))
    per_head = per_head if family.qk_norm else ()
    mlp, mlp_weights = _MLPS[family.mlp](v, index)
    norm = tuple(Module(name, "other", hidden) for name in family.norms)
    weights = _weights(attention) + [(f"{m.name}.weight", m.params) for m in (*per_head, *norm)] + mlp_weights
    modules = (Module("self_attn", "other", sum(m.params for m in (*attention, *per_head))), *attention, *per_head,
               Module("mlp", "other", sum(size for _, size in mlp_weights)), *mlp, *norm)  # fmt: skip
    return modules, weights


def _swiglu(v: Any, prefix: str, inner: int, bias: bool = False) -> Block:
    """A SwiGLU MLP named ``prefix``: gate, up and down projections (its own module not included)."""
    hidden = v.hidden_size
    linears = (_linear(f"{prefix}.gate_proj", hidden, inner, bias), _linear(f"{prefix}.up_proj", hidden, inner, bias),
               _linear(f"{prefix}.down_proj", inner, hidden, bias))  # fmt: skip
    return (*linears, Module(f"{prefix}.act_fn", "other", 0)), _weights(linears)


def _routed(v: Any, experts: int, inner: int) -> Block:
    """A router (``mlp.gate``: one [E, h] weight, no linear) and routed experts packed as ``gate_up_proj``
    [E, 2i, h] and ``down_proj`` [E, h, i]: Mixtral's and Qwen2-MoE's, the same in transformers 5.0 and 5.24."""
    hidden = v.hidden_size
    weights = [("mlp.gate.weight", experts * hidden), ("mlp.experts.gate_up_proj", experts * 2 * inner * hidden),
               ("mlp.experts.down_proj", experts * hidden * inner)]  # fmt: skip
    router, packed = weights[0][1], weights[1][1] + weights[2][1]
    modules = (Module("mlp.gate", "other", router), Module("mlp.experts", "other", packed),
               Module("mlp.experts.act_fn", "other", 0))  # fmt: skip
    return modules, weights


def _qwen2_moe(v: Any, index: int) -> Block:
    """Qwen2-MoE's layer ``index``: dense when listed in ``mlp_only_layers`` or off ``decoder_sparse_step``
    (``Qwen2MoeDecoderLayer.__init__``), else routed experts, a shared expert and its sigmoid gate (a linear h -> 1)."""
    if index in (v.mlp_only_layers or ()) or (index + 1) % v.decoder_sparse_step:
        return _swiglu(v, "mlp", v.intermediate_size)
    routed, routed_weights = _routed(v, v.num_experts, v.moe_intermediate_size)
    shared, shared_weights = _swiglu(v, "mlp.shared_expert", v.shared_expert_intermediate_size)
    gate = _linear("mlp.shared_expert_gate", v.hidden_size, 1, False)
    expert = Module("mlp.shared_expert", "other", sum(size for _, size in shared_weights))
    return (*routed, expert, *shared, gate), routed_weights + shared_weights + _weights((gate,))


_MLPS = {
    "dense": lambda v, index: _swiglu(v, "mlp", v.intermediate_size, getattr(v, "mlp_bias", False)),
    "mixtral": lambda v, index: _routed(v, v.num_local_experts, v.intermediate_size),
    "qwen2_moe": _qwen2_moe,
}


def _weights(linears: tuple[Module, ...]) -> list[tuple[str, int]]:
    """Linears' parameters: each one's weight, and its bias if it has one."""
    return [(f"{m.name}.{kind}", size) for m in linears
            for kind, size in (("weight", m.in_features * m.out_features), ("bias", m.out_features if m.bias else 0))
            if size]  # fmt: skip
