"""The LoRA a run trains, as one typed and validated :class:`LoraSpec`, and where it puts its adapters in a model
(:func:`place`): what the memory model, the activations, the throughput estimate and the tracer all read.

A spec comes from a PEFT ``LoraConfig`` (``peft_config=``, before the model exists), from a ``PeftModel``'s own config,
or from keywords (``lora_rank``, ``lora_dropout``, ``lora_targets``); :func:`resolve` takes whichever the call gave
and refuses contradictions. Without any, the recipes' LoRA is planned (``hf_dist.recipe_utils.LoraArguments``: rank
16, alpha 32, dropout 0.05, every linear of a Llama block). A PEFT config hf_dist cannot plan (another tuner type,
DoRA, a target name that matches no module of the model) is refused by name, never planned as default LoRA.

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
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

# the recipes' LoRA (hf_dist.recipe_utils.LoraArguments): planned when a call names no LoRA of its own
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RECIPE_RANK, RECIPE_ALPHA, RECIPE_DROPOUT = 16, 32.0, 0.05
ALL_LINEAR = "all-linear"  # PEFT's INCLUDE_LINEAR_LAYERS_SHORTHAND
BIASES = ("none", "all", "lora_only")
SOURCES = ("default", "keywords", "peft_config", "PeftModel")
_SOURCE_TEXT = {"default": "the recipes' default LoRA", "keywords": "the lora_* keywords",
                "peft_config": "peft_config", "PeftModel": "the PeftModel's config"}  # fmt: skip

# LoraConfig options whose memory hf_dist does not model: (their default, what they change)
_UNPLANNED = {
    "use_dora": (False, "DoRA runs each adapted linear's base weight again to scale it by its norm "
                 "(PEFT DoraLinearLayer)"),
    "inference_mode": (False, "an adapter in inference mode trains nothing (load it with PeftModel.from_pretrained(..., "
                       "is_trainable=True))"),
    "layer_replication": (None, "replicated layers share weights that the memory model counts once"),
    "target_parameters": (None, "LoRA on parameters (PEFT ParamWrapper, e.g. MoE experts)"),
    "trainable_token_indices": (None, "trainable token rows of the embedding"),
    "megatron_config": (None, "Megatron tensor-parallel LoRA layers"),
    "alora_invocation_tokens": (None, "activated LoRA (aLoRA)"),
    "use_qalora": (False, "QA-LoRA's pooled adapters"),
    "use_bdlora": (None, "block-diagonal LoRA"),
    "arrow_config": (None, "Arrow routing between adapters"),
    "kasa_config": (None, "KaSA adapters"),
    "velora_config": (None, "VeLoRA's compressed activations"),
    "monteclora_config": (None, "MonteCLoRA's sampled adapters"),
}  # fmt: skip


def _tuple(value: Any) -> tuple | str | None:
    """A PEFT list field (list, set, tuple) as a sorted tuple; a string or None as given."""
    if value is None or isinstance(value, str):
        return value
    return tuple(sorted(value)) if isinstance(value, (set, frozenset)) else tuple(value)


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA a run trains, in PEFT ``LoraConfig``'s terms.

    ``rank`` (``r``) and ``alpha`` (``lora_alpha``; ``use_rslora`` scales by ``alpha / sqrt(r)``: no memory change);
    ``dropout`` (``lora_dropout``: > 0 keeps a copy of each adapter's input and its mask); ``targets``
    (``target_modules``: names, a regex, ``"all-linear"``, or None for PEFT's default of the model type);
    ``exclude`` (``exclude_modules``), ``layers`` (``layers_to_transform``) and ``layers_pattern``;
    ``modules_to_save`` (each matched module is copied and the copy trains); ``bias`` (``none``, ``all``: every bias
    trains, ``lora_only``: the adapted linears' biases); ``lora_bias`` (``lora_B`` gets a bias); ``rank_pattern``
    (per-module ranks, ``(pattern, rank)`` pairs). ``source``: where it came from (``default``, ``keywords``,
    ``peft_config``, ``PeftModel``); a target name that matches nothing is refused unless it is the default's or a
    PeftModel's (PEFT itself only refuses when no name matches).
    """

    rank: int = RECIPE_RANK
    alpha: float = RECIPE_ALPHA
    dropout: float = RECIPE_DROPOUT
    targets: tuple[str, ...] | str | None = DEFAULT_TARGETS
    exclude: tuple[str, ...] | str | None = None
    layers: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | str | None = None
    modules_to_save: tuple[str, ...] = ()
    bias: str = "none"
    lora_bias: bool = False
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = field(default=())
    source: str = "default"

    def __post_init__(self) -> None:
        for name in ("targets", "exclude", "layers_pattern", "modules_to_save", "rank_pattern"):
            value = getattr(self, name)
            object.__setattr__(self, name, _tuple(value.items() if isinstance(value, dict) else value))
        if isinstance(self.layers, int) and not isinstance(self.layers, bool):
            object.__setattr__(self, "layers", (self.layers,))
        object.__setattr__(self, "layers", _tuple(self.layers))
        object.__setattr__(self, "modules_to_save", self.modules_to_save or ())
        self._check()

    def _check(self) -> None:
        where = _SOURCE_TEXT.get(self.source, self.source)
        if self.source not in SOURCES:
            raise ValueError(f"LoraSpec.source must be one of {list(SOURCES)}, got {self.source!r}")
        if not _positive_int(self.rank) or not all(_positive_int(r) for _, r in self.rank_pattern):
            raise ValueError(f"LoRA rank (r) must be a positive int, got {self.rank!r} ({where}); e.g. r=16")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora_alpha must be a positive number, got {self.alpha!r} ({where}); e.g. 2 * r")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.dropout!r} ({where}); e.g. 0.0 or 0.05")
        if self.bias not in BIASES:
            raise ValueError(f"LoRA bias must be one of {list(BIASES)}, got {self.bias!r} ({where})")
        if self.targets is not None and not self.targets:
            raise ValueError(f"LoRA target_modules is empty ({where}); name the linears to adapt, e.g. q_proj v_proj")

    @property
    def strict(self) -> bool:
        """Every target name must match a module (a user's config or keywords; a typo must not pass silently)."""
        return self.source in ("keywords", "peft_config")

    @property
    def all_linear(self) -> bool:
        return isinstance(self.targets, str) and self.targets.lower() == ALL_LINEAR

    def same_run(self, other: LoraSpec, spec: Any = None) -> bool:
        """The same adapters, wherever each spec came from: the same fields, or, on the model ``spec``, the same
        placement and training settings (PEFT rewrites ``"all-linear"`` into the names it matched)."""
        if replace(self, source="default") == replace(other, source="default"):
            return True
        if spec is None:
            return False
        fields = ("rank", "alpha", "dropout", "bias", "lora_bias", "use_rslora")
        mine, theirs = place(spec, self), place(spec, other)
        placed = (mine.layers, mine.outer, mine.saved_params) == (theirs.layers, theirs.outer, theirs.saved_params)
        return placed and all(getattr(self, f) == getattr(other, f) for f in fields)

    def describe(self) -> str:
        """``r=64, alpha=128, dropout 0.0 on q_proj, v_proj (the PeftModel's config)``."""
        targets = self.targets if isinstance(self.targets, str) else ", ".join(self.targets or ("PEFT's default",))
        extra = [f"modules_to_save {', '.join(self.modules_to_save)}"] if self.modules_to_save else []
        extra += [f"bias={self.bias}"] if self.bias != "none" else []
        extra += ["rsLoRA"] if self.use_rslora else []
        extra += [f"layers {list(self.layers)}"] if self.layers is not None else []
        return (f"r={self.rank}, alpha={self.alpha:g}, dropout {self.dropout:g} on {targets}"
                + "".join(f", {e}" for e in extra) + f" ({_SOURCE_TEXT[self.source]})")  # fmt: skip

    def peft_kwargs(self) -> dict[str, Any]:
        """``peft.LoraConfig`` keywords of the same adapters (the tracer builds them with ``get_peft_model``)."""
        listed = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
        return {
            "r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout, "target_modules": listed(self.targets),
            "exclude_modules": listed(self.exclude), "layers_to_transform": listed(self.layers),
            "layers_pattern": listed(self.layers_pattern), "modules_to_save": list(self.modules_to_save) or None,
            "bias": self.bias, "lora_bias": self.lora_bias, "use_rslora": self.use_rslora,
            "rank_pattern": dict(self.rank_pattern),
        }  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, **self.peft_kwargs()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoraSpec:
        return from_peft_config({**data, "peft_type": "LORA"}, data.get("source", "peft_config"))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ---------------------------------------------------------------- where a spec comes from


def from_peft_config(config: Any, source: str = "peft_config") -> LoraSpec:
    """The spec of a PEFT ``LoraConfig`` (or its dict, an ``adapter_config.json``); any other tuner type, or an
    option whose memory is not modelled (:data:`_UNPLANNED`), is refused by name."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    where = _SOURCE_TEXT[source]
    kind = get("peft_type")
    kind = str(getattr(kind, "value", kind) or "")
    if kind.upper() != "LORA":
        raise ValueError(
            f"{where} is a {kind or type(config).__name__} adapter (peft_type {kind or None!r}); hf_dist plans LoRA "
            "adapters only (PEFT LoraConfig): use a LoraConfig, or plan method='full'"
        )
    for name, (default, what) in _UNPLANNED.items():
        value = get(name, default)
        if value != default and (value or default):  # an empty list or dict is the default too
            raise ValueError(
                f"{where} sets {name}={value!r}: {what}, which hf_dist does not plan; drop {name} to plan plain LoRA"
            )
    return LoraSpec(
        rank=get("r", 8), alpha=get("lora_alpha", 8), dropout=get("lora_dropout", 0.0),
        targets=get("target_modules"), exclude=get("exclude_modules"), layers=get("layers_to_transform"),
        layers_pattern=get("layers_pattern"), modules_to_save=get("modules_to_save") or (), bias=get("bias", "none"),
        lora_bias=bool(get("lora_bias", False)), use_rslora=bool(get("use_rslora", False)),
        rank_pattern=get("rank_pattern") or {}, source=source,
    )  # fmt: skip


def is_peft_model(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def from_peft_model(model: Any) -> LoraSpec:
    """The spec of a ``PeftModel``'s active adapter (one; several active adapters are refused)."""
    active = getattr(model, "active_adapters", None) or [getattr(model, "active_adapter", "default")]
    active = [active] if isinstance(active, str) else list(active)
    if len(active) != 1:
        raise ValueError(
            f"the PeftModel has {len(active)} active adapters {active}; hf_dist plans one: model.set_adapter(name)"
        )
    return from_peft_config(model.peft_config[active[0]], "PeftModel")


def resolve(model: Any, method: str | None, peft_config: Any = None, **keywords: Any) -> tuple[str, LoraSpec | None]:
    """(the method, the LoRA it trains) of one call: a ``PeftModel``'s config and ``peft_config`` must agree, and the
    ``lora_rank`` / ``lora_dropout`` / ``lora_targets`` keywords (None: not given) may only say what they say;
    without either, the keywords over the recipes' default. ``method`` None: ``lora`` when any of them was given,
    else ``full``."""
    given = {k: v for k, v in keywords.items() if v is not None}
    found = [from_peft_model(model)] if is_peft_model(model) else []
    found += [from_peft_config(peft_config)] if peft_config is not None else []
    if len(found) == 2 and not found[0].same_run(found[1], _spec_of(model)):
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
    return _tuple(value)


def _check_keywords_agree(spec: LoraSpec, given: dict[str, Any]) -> None:
    values = {"lora_rank": spec.rank, "lora_dropout": spec.dropout, "lora_targets": spec.targets}
    wrong = [f"{k}={v!r} but {_SOURCE_TEXT[spec.source]} has {values.get(k)!r}" for k, v in given.items()
             if (_targets(v) if k == "lora_targets" else v) != values.get(k)]  # fmt: skip
    if wrong:
        raise ValueError(f"{'; '.join(wrong)}: its own LoRA is planned; drop {', '.join(sorted(given))}")


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
                f"({_SOURCE_TEXT[lora.source]}: target_modules={lora.targets!r}); hf_dist plans LoRA on linear layers: "
                "name linears only (or put the module in modules_to_save)"
            )
        adapter = Adapter(module.name, module.in_features, module.out_features, _rank(lora, key), module.bias)
        (layers[index] if index is not None else outer).append(adapter)
    if not any(layers) and not outer:
        raise ValueError(
            f"LoRA target_modules={lora.targets!r} ({_SOURCE_TEXT[lora.source]}) adapts no linear layer of "
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
            f"{_SOURCE_TEXT[lora.source]} has no target_modules and PEFT has no default for model_type "
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
            f"LoRA target_modules={lora.targets!r} ({_SOURCE_TEXT[lora.source]}) on a {spec.model_type} model: PEFT "
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
            f"{_SOURCE_TEXT[lora.source]}: {', '.join(misses)} matches no module of the model; its modules are named "
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
