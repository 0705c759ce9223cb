"""What the planner needs to know about a model: parameter counts and shape, without allocating weights.

``model_spec`` accepts a bare parameter count, a transformers config (or its dict), a built
``nn.Module`` (PEFT-wrapped too), a local folder / ``config.json`` path, or a hub name. A Llama, Mistral, Qwen2,
Qwen3, Gemma 2, Mixtral or Qwen2-MoE config (a dict or a local file) is counted by arithmetic without importing
transformers (:mod:`hf_dist.planning.families`); any other comes from instantiating the model on the
``meta`` device, which allocates no storage: a Llama-3.1-405B config counts in about half a second.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from hf_dist.planning.config_checks import check_config_dict, check_dimensions
from hf_dist.planning.families import FAMILIES, Counts, Inventory, Module, describe
from hf_dist.planning.lora import DEFAULT_TARGETS
from hf_dist.planning.model_source import (
    check_causal_lm,
    config_from_dict,
    is_config,
    load_config,
    local_config_dict,
    meta_model,
)
from hf_dist.planning.moe import MlaShape, MoeLayout, mla_shape, moe_layout
from hf_dist.planning.precision import is_module
from hf_dist.planning.remote_code import check_trust_flag
from hf_dist.planning.tensor_split import TensorSplit, tensor_split


@dataclass(frozen=True)
class ModelSpec:
    """Parameter counts and shape of a causal LM, enough for the memory model."""

    num_params: int  # total trainable-capable params, tied embeddings counted once (LoRA adapters excluded)
    num_layers: int = 0  # decoder layers (0 when unknown, e.g. a bare count)
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    layer_params: int = 0  # params in the largest decoder layer (= one FSDP unit; an MoE layer, not a dense one)
    embedding_params: int = 0  # input embedding only; an untied lm_head has as many again
    model_type: str | None = None
    name: str | None = None
    config: Any = None  # the transformers PretrainedConfig when known (its fields' view: hf_dist.planning.families)
    head_dim: int = 0  # attention head size (hidden_size // heads unless the config says otherwise)
    norms_per_layer: int = 2  # normalisation modules in one decoder layer (Gemma 2/3 have 4)
    logit_softcapping: bool = False  # the LM head applies tanh soft-capping to the logits (Gemma 2)
    attention_softcapping: bool = False  # eager attention soft-caps its scores with tanh (Gemma 2)
    tp_plan: bool = False  # the config has a tensor-parallel plan (``base_model_tp_plan``: from_pretrained(tp_plan=))
    tp_split: TensorSplit | None = None  # what that plan splits in the layers (None: every linear, as in Llama's)
    # (name, in_features, out_features) of each linear of one decoder layer that LoRA adapts
    # (:data:`hf_dist.planning.lora.DEFAULT_TARGETS`)
    lora_linears: tuple[tuple[str, int, int], ...] = ()
    experts: int = 0  # routed experts per MoE layer (0: a dense feed-forward block)
    experts_per_token: int = 0  # experts each token is routed to (top-k)
    moe: MoeLayout | None = None  # an MoE model's shared experts, dense layers and router (hf_dist.planning.moe)
    mla: MlaShape | None = None  # DeepSeek's multi-head latent attention (hf_dist.planning.moe.MlaShape)
    attention: str = (
        "sdpa"  # the attention transformers runs by default: "eager" where the model refuses sdpa (Gemma 2)
    )
    checkpoint_bytes: int = 2  # bytes per parameter in the saved weights (the config's dtype; hub models: bf16)
    # what LoRA can adapt or save (hf_dist.planning.lora_plan.place): the decoder layers' ModuleList name, one layer's
    # modules (names relative to the layer), the modules outside the layers, the input and output embeddings' names
    # and every parameter named ``bias``
    layer_prefix: str = ""
    layer_modules: tuple[Module, ...] = ()
    outer_modules: tuple[Module, ...] = ()
    input_module: str = ""
    output_module: str = ""
    bias_params: int = 0

    def __post_init__(self) -> None:
        for field in ("num_params", "num_layers", "hidden_size", "layer_params", "embedding_params"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelSpec.{field} must be a non-negative int, got {value!r}")
        if self.num_params <= 0:
            raise ValueError(f"ModelSpec.num_params must be positive, got {self.num_params}; pass a real model size")

    @property
    def has_shape(self) -> bool:
        """True when layer/hidden sizes are known (needed for activations and LoRA)."""
        return self.num_layers > 0 and self.hidden_size > 0

    @property
    def lm_head_params(self) -> int:
        """Params of the output projection when it is a separate matrix (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.embedding_params

    def tensor_parallel_shard(self, tp_size: int, *, vocab_parallel_embedding: bool = True) -> ModelSpec:
        """What one rank of a ``tp_size`` tensor-parallel group holds, as a spec the memory model reads unchanged.

        torch TP splits what the model's plan names (``tp_split``, :mod:`hf_dist.planning.tensor_split`; a Llama's
        plan: q/k/v/gate/up column-wise and o/down row-wise), so those weights, the heads, KV heads and the MLP
        width split, while norms, routers and linears the plan misses stay whole on every rank. ``embed_tokens`` is
        split by vocabulary rows (``embedding_rowwise``) and ``lm_head`` column-wise with its output gathered, so
        both weights split but the logits come back whole (``vocab_size`` stays); the residual stream
        (``hidden_size``) is replicated. ``vocab_parallel_embedding=False``: DeepSpeed AutoTP, which replaces every
        linear and ``lm_head`` but leaves ``embed_tokens`` whole on every rank (measured on 2 CPU ranks);
        ``embedding_params`` then stays the whole embedding, ``num_params`` counts the head's shard.
        """
        if tp_size == 1:
            return self
        if not self.has_shape:
            raise ValueError("tensor parallelism needs the model's shape; pass a config, folder or model, not a count")
        norms = self.norms_per_layer * self.hidden_size
        layers = self.tp_split.layers_params if self.tp_split is not None else self.num_layers * self.layer_params
        every_linear = TensorSplit(norms, self.num_layers * norms, layers)
        split = self.tp_split if self.tp_split is not None and vocab_parallel_embedding else every_linear
        layer = math.ceil((self.layer_params - split.whole_params) / tp_size) + split.whole_params
        in_layers = math.ceil((split.layers_params - split.whole_in_layers) / tp_size) + split.whole_in_layers
        head_shard = math.ceil(self.embedding_params / tp_size)
        embedding = head_shard if vocab_parallel_embedding else self.embedding_params
        # outside the layers and the embeddings: the final norm, whole on every rank
        rest = self.num_params - split.layers_params - self.embedding_params - self.lm_head_params
        head = 0 if self.tie_word_embeddings else head_shard
        heads = tp_size if split.heads else 1
        moe = self.moe and replace(self.moe, shared_size=split.split(self.moe.shared_size, tp_size, split.shared),
                                   dense_size=split.split(self.moe.dense_size, tp_size, split.dense))  # fmt: skip
        return replace(
            self,
            num_params=rest + in_layers + embedding + head,
            layer_params=layer,
            embedding_params=embedding,
            num_attention_heads=self.num_attention_heads // heads,
            num_key_value_heads=max(self.num_key_value_heads // heads, 1),
            intermediate_size=split.split(self.intermediate_size, tp_size, split.mlp),
            moe=moe,
        )


def model_spec(model: Any, *, trust_remote_code: bool = False) -> ModelSpec:
    """Describe ``model``: int (or integral float, 7.5e9) | PretrainedConfig | dict | nn.Module (incl. PEFT) | str (dir, config.json, hub name).

    ``trust_remote_code=True`` lets a config's ``auto_map`` classes be imported from its folder; without it they
    never are (:mod:`hf_dist.planning.remote_code`: a registered causal LM is planned from transformers' own
    class, anything else raises :class:`~hf_dist.planning.remote_code.RemoteCodeError`).
    """
    trust = check_trust_flag(trust_remote_code)
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, bool):
        raise ValueError(f"model must be a parameter count, config, module or name, got {model!r}")
    if isinstance(model, int):
        return ModelSpec(num_params=model)
    if isinstance(model, float):
        return ModelSpec(num_params=_integral_count(model))
    if isinstance(model, (str, os.PathLike)):
        count = _count_in_text(os.fspath(model))
        if count is not None:  # "7.5e9" on the command line: a bare count, never a hub name
            return ModelSpec(num_params=count)
        local = local_config_dict(os.fspath(model))
        described = _described_spec(*local, name=str(model)) if local is not None else None
        if described is not None:
            return described
        config = load_config(os.fspath(model), trust_remote_code=trust)
        return spec_from_config(config, name=str(model), trust_remote_code=trust)
    if isinstance(model, dict):
        return _described_spec(model, "model config") or spec_from_config(
            config_from_dict(model), trust_remote_code=trust
        )
    if is_config(model):
        return spec_from_config(model, trust_remote_code=trust)
    if is_module(model):
        return spec_from_module(model)
    raise ValueError(
        f"cannot describe a model of type {type(model).__name__}; pass a parameter count, a transformers config, "
        "a config dict, an nn.Module, a local folder / config.json path or a hub name"
    )


def _count_in_text(text: str) -> int | None:
    """A parameter count written as text (``7.5e9``, ``8000000000``) that is no existing path; else None."""
    if os.path.exists(text):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return _integral_count(value)


def _integral_count(value: float) -> int:
    """A parameter count written as a float (``7.5e9``) as an int; a fractional or non-finite one is refused."""
    if not math.isfinite(value) or not value.is_integer():
        raise ValueError(
            f"a parameter count must be a whole number, got {value!r} (not integral); pass e.g. 7.5e9 or 7_500_000_000"
        )
    return int(value)


def spec_from_config(config: Any, *, name: str | None = None, trust_remote_code: bool = False) -> ModelSpec:
    """Count params by building the model on the meta device (no storage is allocated); the folder's own
    ``auto_map`` class only with ``trust_remote_code`` (:func:`check_causal_lm`)."""
    remote = check_causal_lm(config, trust_remote_code=trust_remote_code)
    check_dimensions(config, name=name)
    key = (type(config).__name__, config.to_json_string(use_diff=False), remote)
    if key not in _COUNT_CACHE:
        _COUNT_CACHE[key] = _module_counts(meta_model(config, trust_remote_code=trust_remote_code))
    return _spec(config, _COUNT_CACHE[key], name=name or getattr(config, "_name_or_path", None) or None)


def _described_spec(data: dict, where: str, name: str | None = None) -> ModelSpec | None:
    """The spec of a config :func:`hf_dist.planning.families.describe` models, without transformers; else None.
    ``where`` names the config in a refusal of its fields."""
    if data.get("model_type") not in FAMILIES:
        return None
    check_config_dict(data, where=where)
    found = describe(data, name)
    if found is None:
        return None
    view, counts = found
    check_dimensions(view, name=name)
    return _spec(view, counts, name=name)


# keyed on the config JSON so repeated plans of the same config (CLI, tests) count once
_COUNT_CACHE: dict[tuple[str, str, bool], Counts] = {}


_ADAPTER_MARKERS = ("lora_", "modules_to_save", "prompt_encoder", "ia3_")


def _module_counts(model: Any) -> Counts:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    total = sum(p.numel() for n, p in base.named_parameters() if not any(m in n for m in _ADAPTER_MARKERS))
    layers = _decoder_layers(base)
    layer, norms, linears, index = 0, 2, (), 0
    if layers is not None and len(layers):
        # the largest layer describes them all: DeepSeek's first layers are dense, the rest mixtures of experts
        sizes = [sum(p.numel() for n, p in m.named_parameters() if not any(a in n for a in _ADAPTER_MARKERS))
                 for m in layers]  # fmt: skip
        index = max(range(len(sizes)), key=sizes.__getitem__)
        layer = sizes[index]
        norms = sum(1 for m in layers[index].modules() if "norm" in type(m).__name__.lower()) or 2
        linears = _lora_linears(layers[index])
    embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    embedding = embed.weight.numel() if embed is not None and hasattr(embed, "weight") else 0
    attention = "sdpa" if getattr(type(base), "_supports_sdpa", True) else "eager"
    inventory = _inventory(base, layers, index)
    split = tensor_split(layers, inventory.layer_prefix, getattr(base, "tp_plan", None), index)
    return Counts(total, layer, embedding, norms, linears, attention, inventory, split)


def _inventory(base: Any, layers: Any, index: int = 0) -> Inventory:
    """Every module PEFT could adapt or save, named as PEFT's matching sees them (:class:`Module`): one decoder
    layer's (relative names; the layers share one class; layer ``index``, the largest) and those outside the layers.
    A PEFT-wrapped module is described by what it wraps (a LoRA layer's ``base_layer``, a ``ModulesToSaveWrapper``'s
    ``original_module``)."""
    names = {id(m): n for n, m in base.named_modules()}
    prefix = names.get(id(layers), "") if layers is not None and len(layers) else ""
    first = f"{prefix}.{index}." if prefix else None
    in_layer, outer, skipping = [], [], None
    for name, module in base.named_modules():
        if not name or (skipping and name.startswith(skipping)):
            continue
        module, wrapped = _unwrapped(module)
        skipping = f"{name}." if wrapped else skipping
        if first and name.startswith(first):
            in_layer.append(_described(name[len(first) :], module))
        elif not (prefix and (name == prefix or name.startswith(prefix + ".") or prefix.startswith(name + "."))):
            outer.append(_described(name, module))
    embeddings = [getattr(base, f, lambda: None)() for f in ("get_input_embeddings", "get_output_embeddings")]
    biases = sum(p.numel() for n, p in base.named_parameters()
                 if (n == "bias" or n.endswith(".bias")) and not any(m in n for m in _ADAPTER_MARKERS))  # fmt: skip
    ends = [names.get(id(e), "") if e is not None else "" for e in embeddings]
    return Inventory(prefix, tuple(in_layer), tuple(outer), ends[0], ends[1], biases)


def _unwrapped(module: Any) -> tuple[Any, bool]:
    """(the module PEFT wrapped, True) for a LoRA layer or a ``ModulesToSaveWrapper``; (``module``, False) else."""
    for attribute in ("base_layer", "original_module"):
        inner = getattr(module, attribute, None)
        if inner is not None and hasattr(inner, "parameters"):
            return inner, True
    return module, False


def _described(name: str, module: Any) -> Module:
    """``module`` as a :class:`Module`: a linear's features from its weight (transformers' ``Conv1D`` stores
    ``(in, out)``, ``nn.Linear`` ``(out, in)``)."""
    import torch

    params = sum(p.numel() for p in module.parameters())
    bias = getattr(module, "bias", None) is not None
    if isinstance(module, torch.nn.Linear):
        return Module(name, "linear", params, module.in_features, module.out_features, bias)
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return Module(name, "linear", params, *module.weight.shape, bias)
    if isinstance(module, torch.nn.Embedding):
        return Module(name, "embedding", params, module.num_embeddings, module.embedding_dim)
    return Module(name, "other", params)


def _lora_linears(layer: Any) -> tuple[tuple[str, int, int], ...]:
    """The linears of a decoder layer named like a LoRA target (a PEFT-wrapped one through its base layer)."""
    import torch

    out = []
    for name, module in layer.named_modules():
        short = name.rsplit(".", 1)[-1]
        module = getattr(module, "base_layer", module)
        if short in DEFAULT_TARGETS and isinstance(module, torch.nn.Linear):
            out.append((short, module.in_features, module.out_features))
    return tuple(out)


def _decoder_layers(model: Any) -> Any:
    """The longest nn.ModuleList whose children share one class: the repeated decoder block."""
    import torch

    best = None
    for module in model.modules():
        repeated = isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1
        if repeated and (best is None or len(module) > len(best)):
            best = module
    return best


def spec_from_module(model: Any) -> ModelSpec:
    counts = _module_counts(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or not is_config(config):
        layers = _decoder_layers(base)
        return ModelSpec(num_params=counts.total, num_layers=len(layers) if layers is not None else 0,
                         layer_params=counts.layer, **counts.inventory._asdict())  # fmt: skip
    return _spec(config, counts, name=getattr(config, "_name_or_path", None) or None)


def _spec(config: Any, counts: Counts, *, name: str | None) -> ModelSpec:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    # GPT-2 style configs have no intermediate_size: n_inner, else the conventional 4 * hidden
    inter = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    # mixture of experts (Mixtral: num_local_experts; Qwen-MoE, OLMoE: num_experts; DeepSeek: n_routed_experts)
    experts = next((getattr(text, k) for k in _EXPERT_KEYS if getattr(text, k, None)), 0)
    per_token = int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0
    inter = getattr(text, "moe_intermediate_size", None) or inter if experts else inter
    return ModelSpec(
        num_params=counts.total,
        num_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=int(inter),
        vocab_size=int(getattr(text, "vocab_size", 0) or 0),
        max_position_embeddings=getattr(text, "max_position_embeddings", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        layer_params=counts.layer,
        embedding_params=counts.embedding,
        model_type=getattr(config, "model_type", None),
        name=name,
        config=config,
        head_dim=int(head_dim),
        norms_per_layer=counts.norms,
        logit_softcapping=bool(getattr(text, "final_logit_softcapping", None)),
        attention_softcapping=bool(getattr(text, "attn_logit_softcapping", None)),
        tp_plan=bool(getattr(text, "base_model_tp_plan", None)),
        lora_linears=counts.lora_linears,
        tp_split=counts.tensor_split,
        attention=counts.attention,
        experts=int(experts),
        experts_per_token=per_token,
        moe=moe_layout(text, getattr(config, "model_type", None), int(getattr(text, "num_hidden_layers", 0) or 0))
        if experts
        else None,
        mla=mla_shape(text),
        checkpoint_bytes=_dtype_bytes(getattr(config, "dtype", None) or getattr(text, "dtype", None)),
        **counts.inventory._asdict(),
    )


def _dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a config's ``dtype`` (a torch dtype or its name); 2 when unknown."""
    name = str(dtype or "").removeprefix("torch.")
    return {"float32": 4, "float64": 8, "float8_e4m3fn": 1, "int8": 1}.get(name, 2)


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
