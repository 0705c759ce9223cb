"""The LoRA a run trains, as one typed and validated :class:`LoraSpec`, read from a PEFT ``LoraConfig``
(``peft_config=``, before the model exists), from a ``PeftModel``'s own config, or from keywords (``lora_rank``,
``lora_dropout``, ``lora_targets``). :func:`hf_dist.planning.lora_plan.resolve` takes whichever a call gave and
refuses contradictions, and :func:`hf_dist.planning.lora_plan.place` puts the adapters in the model. Without any, the
recipes' LoRA is planned (``hf_dist.recipe_utils.LoraArguments``: rank 16, alpha 32, dropout 0.05, every linear of a
Llama block). A PEFT config hf_dist cannot plan (another tuner type, DoRA, a target name that matches no module of
the model) is refused by name, never planned as default LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

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


def tuple_of(value: Any) -> tuple | str | None:
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
            object.__setattr__(self, name, tuple_of(value.items() if isinstance(value, dict) else value))
        if isinstance(self.layers, int) and not isinstance(self.layers, bool):
            object.__setattr__(self, "layers", (self.layers,))
        object.__setattr__(self, "layers", tuple_of(self.layers))
        object.__setattr__(self, "modules_to_save", self.modules_to_save or ())
        self._check()

    def _check(self) -> None:
        where = self.source_text
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

    def same_run(self, other: LoraSpec) -> bool:
        """The same fields, wherever each spec came from (:func:`hf_dist.planning.lora_plan.same_adapters` also
        compares where they go on a model)."""
        return replace(self, source="default") == replace(other, source="default")

    @property
    def source_text(self) -> str:
        """Where the spec came from, as a refusal names it: ``the PeftModel's config``."""
        return _SOURCE_TEXT.get(self.source, self.source)

    def describe(self) -> str:
        """``r=64, alpha=128, dropout 0.0 on q_proj, v_proj (the PeftModel's config)``."""
        targets = self.targets if isinstance(self.targets, str) else ", ".join(self.targets or ("PEFT's default",))
        extra = [f"modules_to_save {', '.join(self.modules_to_save)}"] if self.modules_to_save else []
        extra += [f"bias={self.bias}"] if self.bias != "none" else []
        extra += ["rsLoRA"] if self.use_rslora else []
        extra += [f"layers {list(self.layers)}"] if self.layers is not None else []
        return (f"r={self.rank}, alpha={self.alpha:g}, dropout {self.dropout:g} on {targets}"
                + "".join(f", {e}" for e in extra) + f" ({self.source_text})")  # fmt: skip

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
