"""The LoRA one call plans (:func:`resolve`: a ``PeftModel``'s config, ``peft_config=`` or keywords, agreeing) and where
its adapters go in the model (:func:`place` -> :class:`Placement`), matched as PEFT matches.

Matching follows PEFT 0.21: ``peft/tuners/tuners_utils.py`` ``check_target_module_exists`` (a list of names matches a
module whose key equals a name or ends with ``.name``; a string is a regex that must match the whole key;
``exclude_modules``, ``modules_to_save`` and ``layers_to_transform`` as there) and ``_maybe_include_all_linear_layers``
(``"all-linear"``: every linear but the output embedding); ``utils/other.py`` ``_set_trainable`` (a
``modules_to_save`` name matches a key that ends with it; the module is copied and the copy trains) and
``get_pattern_key`` (``rank_pattern``); ``_mark_only_adapters_as_trainable`` (``bias``). Pure: no model is built
here; the module inventory is the :class:`~hf_dist.planning.modelinfo.ModelSpec`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from hf_dist.planning.lora import LoraSpec, from_peft_config, from_peft_model, is_peft_model, tuple_of


def resolve(model: Any, method: str | None, peft_config: Any = None, **keywords: Any) -> tuple[str, LoraSpec | None]:
    """(the method, the LoRA it trains) of one call: a ``PeftModel``'s config and ``peft_config`` must agree, and the
    ``lora_rank`` / ``lora_dropout`` / ``lora_targets`` keywords (None: not given) may only say what they say;
    without either, the keywords over the recipes' default. ``method`` None: ``lora`` when any of them was given,
    else ``full``."""
    given = {k: v for k, v in keywords.items() if v is not None}
    found = [from_peft_model(model)] if is_peft_model(model) else []
    found += [from_peft_config(peft_config)] if peft_config is not None else []
    if len(found) == 2 and not same_adapters(found[0], found[1], _spec_of(model)):
        raise ValueError(
            f"the PeftModel's LoRA ({found[0].describe()}) and peft_config ({found[1].describe()}) differ; pass one"
        )
    if method is None:
        method = "lora" if found or given else "full"
    if method == "full":
        if found or given:
            _refuse_full(model, peft_config, given)
        return method, None
    if found:
        _check_keywords_agree(found[0], given)
        return method, found[0]
    fields = {"lora_rank": "rank", "lora_dropout": "dropout", "lora_targets": "targets"}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ValueError(f"unknown LoRA keyword(s) {unknown}; allowed: {sorted(fields)}")
    chosen = {fields[k]: (v if k != "lora_targets" else _targets(v)) for k, v in given.items()}
    return method, LoraSpec(**chosen, source="keywords" if given else "default")


def _refuse_full(model: Any, peft_config: Any, given: dict[str, Any]) -> None:
    parts = ["a PeftModel"] if is_peft_model(model) else []
    parts += ["peft_config"] if peft_config is not None else []
    what = ", ".join(parts + sorted(given))
    raise ValueError(
        f"method='full' trains every weight, but {what} describes LoRA adapters; pass method='lora' (or 'qlora'), "
        f"or drop {what}"
    )


def _spec_of(model: Any) -> Any:
    from hf_dist.planning.modelinfo import model_spec

    return model_spec(model)


def _targets(value: Any) -> tuple[str, ...] | str:
    """``lora_targets`` as PEFT's ``target_modules``: ``"all-linear"`` or a regex as a string, names as a tuple;
    a comma-separated string (``"q_proj,v_proj"``) as names."""
    if isinstance(value, str) and "," in value:
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple_of(value)


def _check_keywords_agree(spec: LoraSpec, given: dict[str, Any]) -> None:
    values = {"lora_rank": spec.rank, "lora_dropout": spec.dropout, "lora_targets": spec.targets}
    wrong = [f"{k}={v!r} but {spec.source_text} has {values.get(k)!r}" for k, v in given.items()
             if (_targets(v) if k == "lora_targets" else v) != values.get(k)]  # fmt: skip
    if wrong:
        raise ValueError(f"{'; '.join(wrong)}: its own LoRA is planned; drop {', '.join(sorted(given))}")


def same_adapters(one: LoraSpec, other: LoraSpec, spec: Any) -> bool:
    """The same adapters, wherever each spec came from: the same fields, or, on the model ``spec``, the same
    placement and training settings (PEFT rewrites ``"all-linear"`` into the names it matched)."""
    if one.same_run(other):
        return True
    fields = ("rank", "alpha", "dropout", "bias", "lora_bias", "use_rslora")
    mine, theirs = place(spec, one), place(spec, other)
    placed = (mine.layers, mine.outer, mine.saved_params) == (theirs.layers, theirs.outer, theirs.saved_params)
    return placed and all(getattr(one, f) == getattr(other, f) for f in fields)


# ---------------------------------------------------------------- where the adapters go


class Adapter(NamedTuple):
    """One adapted linear: its name (relative to its decoder layer, or the full key outside the layers), its
    features, its rank and whether the base linear has a bias."""

    name: str
    in_features: int
    out_features: int
    rank: int
    base_bias: bool = False


@dataclass(frozen=True)
class Placement:
    """Where ``lora``'s adapters go in one model: the adapted linears of every decoder layer (``layers``, one tuple
    per layer) and outside the layers (``outer``); the parameters of the ``modules_to_save`` copies; the base biases
    that train (``bias``); and the leading layers that hold no adapter and see no trainable input (``idle_layers``:
    autograd records nothing there, so they save nothing for backward)."""

    lora: LoraSpec
    layers: tuple[tuple[Adapter, ...], ...]
    outer: tuple[Adapter, ...] = ()
    saved_params: int = 0
    trainable_biases: int = 0
    frozen_inputs: bool = True  # nothing before the decoder layers trains: their input needs no gradient

    @property
    def adapter_params(self) -> int:
        """``r * (in + out)`` per adapter (``lora_A``, ``lora_B``; Hu et al. 2021 sec. 4.1), + ``out`` with
        ``lora_bias``."""
        bias = self.lora.lora_bias
        return sum(a.rank * (a.in_features + a.out_features) + (a.out_features if bias else 0) for a in self.adapters)

    @property
    def adapters(self) -> tuple[Adapter, ...]:
        return tuple(a for layer in self.layers for a in layer) + self.outer

    @property
    def new_params(self) -> int:
        """Parameters PEFT adds: the adapters and the ``modules_to_save`` copies (the originals stay frozen)."""
        return self.adapter_params + self.saved_params

    @property
    def trainable(self) -> int:
        """What ``sum(p.numel() for p in peft_model.parameters() if p.requires_grad)`` counts."""
        return self.new_params + self.trainable_biases

    @property
    def adapters_per_layer(self) -> float:
        return len(self.adapters) / max(len(self.layers), 1)

    @property
    def idle_layers(self) -> int:
        """Leading decoder layers without adapters whose input needs no gradient: autograd records nothing there."""
        if not self.frozen_inputs:
            return 0
        return next((i for i, layer in enumerate(self.layers) if layer), len(self.layers))


def place(spec: Any, lora: LoraSpec) -> Placement:
    """Match ``lora`` against the modules of ``spec`` (:class:`~hf_dist.planning.modelinfo.ModelSpec`) as PEFT does;
    a target that adapts a module other than a linear, a name that matches no module (``lora.strict``), or a config
    that adapts nothing is refused by name."""
    if not spec.has_shape:
        raise ValueError("LoRA/QLoRA estimates need the model's shape; pass a config, folder or model, not a count")
    lora = _with_default_targets(lora, spec)
    _refuse_expert_parameters(lora, spec)
    layer_modules = spec.layer_modules or _llama_modules(spec)
    keys = [(f"{spec.layer_prefix or 'model.layers'}.{i}.{m.name}", m, i) for i in range(spec.num_layers)
            for m in layer_modules] + [(m.name, m, None) for m in spec.outer_modules]  # fmt: skip
    everything = [key for key, _, _ in keys]
    if lora.strict:
        _check_names_match(lora, everything)
    layers: list[list[Adapter]] = [[] for _ in range(spec.num_layers)]
    outer, linears = [], _linear_keys(keys, spec.output_module) if lora.all_linear else None
    for key, module, index in keys:
        if not _targeted(lora, key, linears):
            continue
        if module.kind != "linear":
            raise ValueError(
                f"LoRA target {key} is a{'n' if module.kind[0] in 'aeiou' else ''} {module.kind} module "
                f"({lora.source_text}: target_modules={lora.targets!r}); hf_dist plans LoRA on linear layers: "
                "name linears only (or put the module in modules_to_save)"
            )
        adapter = Adapter(module.name, module.in_features, module.out_features, _rank(lora, key), module.bias)
        (layers[index] if index is not None else outer).append(adapter)
    if not any(layers) and not outer:
        raise ValueError(
            f"LoRA target_modules={lora.targets!r} ({lora.source_text}) adapts no linear layer of "
            f"{spec.name or spec.model_type or 'the model'}; its linears are {_short_names(keys)}"
        )
    saved, saved_keys = _saved(lora, keys)
    biases = spec.bias_params if lora.bias == "all" else 0
    if lora.bias == "lora_only":
        biases = sum(a.out_features for layer in layers for a in layer + outer if a.base_bias)
    # only the output head trains outside the layers (and no bias anywhere): the layers' input needs no gradient
    head = {spec.output_module}
    frozen = {a.name for a in outer} | set(saved_keys) <= head and not (lora.bias == "all" and biases)
    return Placement(lora, tuple(tuple(layer) for layer in layers), tuple(outer), saved, biases, frozen)


def _with_default_targets(lora: LoraSpec, spec: Any) -> LoraSpec:
    """``target_modules=None``: PEFT's default for the model type (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``,
    the one PEFT's ``LoraModel._prepare_adapter_config`` applies)."""
    if lora.targets is not None:
        return lora
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
    except ImportError:
        DEFAULTS = {}  # noqa: N806
    if spec.model_type not in DEFAULTS:
        raise ValueError(
            f"{lora.source_text} has no target_modules and PEFT has no default for model_type "
            f"{spec.model_type!r}; set target_modules (e.g. 'all-linear')"
        )
    default = DEFAULTS[spec.model_type]
    return replace(lora, targets=default if isinstance(default, str) else tuple(default))


def _refuse_expert_parameters(lora: LoraSpec, spec: Any) -> None:
    """Refuse targets PEFT moves onto an MoE model's stacked expert parameters. For model types whose experts
    transformers 5 fuses into ``(experts, out, in)`` parameters, PEFT (``utils/transformers_weight_conversion.py
    _convert_peft_config_moe``: DeepSeek-V2/V3, Qwen3-MoE, OLMoE, ... through ``_MODEL_TO_CONVERSION_PATTERN``, and
    Mixtral) turns every target named like a v4 expert projection (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral
    ``w1``, ``w2``, ``w3``, ``gate``), and ``"all-linear"``'s, into ``target_parameters`` on the experts
    (``lora.ParamWrapper``, which refuses ``lora_dropout`` > 0) and drops it from ``target_modules``, so the shared
    experts' linears of that name are not adapted either. hf_dist plans LoRA on linears: the run would differ."""
    mapping = _peft_expert_targets(spec.model_type)
    if not mapping or (isinstance(lora.targets, str) and not lora.all_linear):
        return
    moved = sorted(mapping) if lora.all_linear else sorted(t for t in lora.targets if _listed(tuple(mapping), t))
    if moved:
        raise ValueError(
            f"LoRA target_modules={lora.targets!r} ({lora.source_text}) on a {spec.model_type} model: PEFT "
            f"moves {moved} onto the stacked expert parameters ({sorted(set(mapping[m] for m in moved))}; "
            "peft/utils/transformers_weight_conversion.py _convert_peft_config_moe), which hf_dist does not plan "
            "(and PEFT's lora.ParamWrapper refuses lora_dropout > 0); target the attention linears by name instead"
        )


def _peft_expert_targets(model_type: str | None) -> dict[str, str]:
    """{v4 target name: the expert parameter PEFT adapts instead} for ``model_type``, from the installed PEFT (empty
    when it has no such conversion)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:
        return {}
    base = getattr(conversion, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    fused = getattr(conversion, "_MOE_FUSED_TARGETS", {}).get(base)
    return dict(getattr(conversion, "_MOE_TARGET_MODULE_MAPPING", {}).get(base, {})) if fused else {}


def _llama_modules(spec: Any) -> tuple:
    """A Llama block's linears from the shape alone (a spec built by hand, without the model's modules)."""
    from hf_dist.planning.modelinfo import Module

    h, inter, q = spec.hidden_size, spec.intermediate_size, spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}  # fmt: skip
    return tuple(Module(name, "linear", i * o, i, o) for name, (i, o) in shapes.items())


def _linear_keys(keys, output_module: str) -> frozenset[str]:
    """``"all-linear"``: every linear's key but the output embedding's (PEFT ``_maybe_include_all_linear_layers``)."""
    return frozenset(k for k, m, _ in keys if m.kind == "linear" and k != output_module)


def _listed(names: tuple[str, ...], key: str) -> bool:
    return key in names or any(key.endswith(f".{n}") for n in names)


def _targeted(lora: LoraSpec, key: str, all_linear: frozenset[str] | None) -> bool:
    """PEFT's ``check_target_module_exists`` for ``key``."""
    if lora.exclude and (
        re.fullmatch(lora.exclude, key) if isinstance(lora.exclude, str) else _listed(lora.exclude, key)
    ):
        return False
    if any(re.match(rf"(^|.*\.){m}($|\..*)", key) for m in lora.modules_to_save):
        return False
    if all_linear is not None:
        found = key in all_linear
    elif isinstance(lora.targets, str):
        return re.fullmatch(lora.targets, key) is not None
    else:
        found = _listed(lora.targets, key)
    return found and (lora.layers is None or _layer_index(lora, key) in lora.layers)


def _layer_index(lora: LoraSpec, key: str) -> int | None:
    """The layer index PEFT reads from a key for ``layers_to_transform`` (its first numbered segment)."""
    patterns = [lora.layers_pattern] if isinstance(lora.layers_pattern, str) else list(lora.layers_pattern or ())
    regexes = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in patterns] or [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    for regex in regexes:
        match = re.match(regex, key)
        if match:
            return int(match.group("idx"))
    return None


def _rank(lora: LoraSpec, key: str) -> int:
    """``rank_pattern``'s rank for ``key`` (PEFT ``get_pattern_key``: the first pattern the key ends with), else r."""
    for pattern, rank in lora.rank_pattern:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return rank
    return lora.rank


def _check_names_match(lora: LoraSpec, keys: list[str]) -> None:
    """Each target name (or the regex) and each ``modules_to_save`` name must match some module of the model."""
    misses = []
    if isinstance(lora.targets, tuple):
        misses += [f"target_modules name {n!r}" for n in lora.targets if not any(_listed((n,), k) for k in keys)]
    elif (
        isinstance(lora.targets, str) and not lora.all_linear and not any(re.fullmatch(lora.targets, k) for k in keys)
    ):
        misses.append(f"target_modules regex {lora.targets!r}")
    misses += [f"modules_to_save name {n!r}" for n in lora.modules_to_save if not any(k.endswith(n) for k in keys)]
    if misses:
        short = sorted({k.rsplit(".", 1)[-1] for k in keys})
        raise ValueError(
            f"{lora.source_text}: {', '.join(misses)} matches no module of the model; its modules are named "
            f"{short}; fix the name (PEFT matches a name that ends a module's key, or a regex of the whole key)"
        )


def _short_names(keys) -> list[str]:
    return sorted({k.rsplit(".", 1)[-1] for k, m, _ in keys if m.kind == "linear"})


def _saved(lora: LoraSpec, keys) -> tuple[int, list[str]]:
    """(parameters of the ``modules_to_save`` copies, their keys): every module whose key ends with a name (PEFT
    ``_set_trainable``), outermost only (a matched module's children are copied with it)."""
    matched = [(k, m) for k, m, _ in keys if any(k.endswith(n) for n in lora.modules_to_save)]
    outermost = [(k, m) for k, m in matched if not any(k.startswith(o + ".") for o, _ in matched)]
    return sum(m.params for _, m in outermost), [k for k, _ in outermost]


def trainable_params(spec: Any, lora: LoraSpec | None = None) -> int:
    """Trainable parameters of ``lora`` (default: the recipes') on ``spec``."""
    return place(spec, lora or LoraSpec()).trainable
