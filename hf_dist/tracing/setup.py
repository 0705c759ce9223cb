"""What the tracer runs: one rank of one planned layout (:class:`TraceSetup`), and which layouts it can run.

A setup is plain data (JSON-able), so the trace can run in a separate process: the fake process group, the fake
tensor mode and the trackers' monkey-patches never touch the caller's process, which may be a training rank with
a real process group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hf_dist.planning.layout import LAYOUT_KEYWORDS, Engine, Layout, ReadsLayout
from hf_dist.planning.lora import DEFAULT_TARGETS, LoraSpec
from hf_dist.tracing.liger.version import version_refusal
from hf_dist.validation import check_choice, check_positive_int

METHODS = ("full", "lora")
DTYPES = ("float32", "bfloat16", "float16")
# PEFT LoRA as the recipes apply it (hf_dist.recipe_utils.LoraArguments): every linear of a Llama-style block
LORA_TARGETS = DEFAULT_TARGETS


class TraceUnsupported(ValueError):
    """The layout cannot be traced here; the message says which part and why (the analytic estimate stands).
    ``reason``: the why alone, one short clause (what ``plan(verify=True)`` prints)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message

    @classmethod
    def refusing(cls, layout: Layout, reason: str) -> TraceUnsupported:
        return cls(f"cannot trace {layout.describe()}: {reason}; the analytic estimate stands", reason)


def check_traceable(setup: TraceSetup, config: Any) -> None:
    """Raise :class:`TraceUnsupported` when ``setup`` cannot be traced for ``config``: the layout
    (:meth:`TraceSetup.untraceable_reason`), or Liger on a model whose Liger patch hf_dist does not copy."""
    from hf_dist.tracing.liger.version import model_refusal

    reason = setup.untraceable_reason() or (model_refusal(config) if setup.use_liger_kernel else None)
    if reason:
        raise TraceUnsupported.refusing(setup.layout, reason)


@dataclass(frozen=True, init=False)
class TraceSetup(ReadsLayout):
    """One rank of a layout, prepared the way ``hf_dist.auto_args()`` + the Trainer run it.

    ``layout``: the run's :class:`~hf_dist.planning.layout.Layout`; or pass its fields flat
    (``TraceSetup("zero3", world_size=8, ...)``), and they are read back the same way (``setup.world_size``).
    ``mixed_precision``: ``bf16``/``fp16`` (autocast with fp32 weights under DDP, FSDP2's ``MixedPrecisionPolicy``
    with fp32 shards) or ``no`` (fp32); ``pure_bf16``: bf16 weights and Adam state.
    ``base_dtype``: the dtype the model is loaded in (a LoRA base stays in it; trainable weights are fp32 under
    mixed precision). ``device``: the hardware planned for (``cuda`` or ``cpu``), which decides the optimizer the
    Trainer builds there. ``lora``: the LoRA applied (:class:`~hf_dist.planning.lora.LoraSpec`, or its dict;
    default for a LoRA method: the recipes'), through PEFT's ``get_peft_model`` with that config, dropout included.
    ``sync_each_batch``: FSDP2 reduce-scatters every micro-batch (accelerate's ``sync_each_batch``: no ``no_sync``).
    """

    layout: Layout
    method: str = "full"
    seq_len: int = 2048
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    base_dtype: str = "bfloat16"
    lora: LoraSpec | None = None
    use_liger_kernel: bool = False
    attention: str | None = None  # None: what transformers runs for the model (sdpa, or eager where it refuses sdpa)
    device: str = "cuda"
    optimizer: str = "adamw"
    fused_lm_head: bool = False  # TRL's fused LM head (not traceable here: untraceable_reason)

    def __init__(self, strategy: str | None = None, *, layout: Layout | None = None, **values: Any) -> None:
        flat = {k: values.pop(k) for k in LAYOUT_KEYWORDS if k in values}
        if layout is None:
            if strategy is None:
                raise TypeError("TraceSetup() needs a strategy (or layout=Layout(...))")
            layout = Layout(strategy, **flat)
        elif strategy is not None or flat:
            raise TypeError(
                f"TraceSetup(layout=...) takes no layout fields beside it; got {sorted(flat) or 'strategy'}"
            )
        own = {f.name: f.default for f in fields(self) if f.name != "layout"}
        unknown = sorted(set(values) - set(own))
        if unknown:
            raise TypeError(
                f"TraceSetup() got unknown keyword(s) {unknown}; allowed: {list(LAYOUT_KEYWORDS) + list(own)}"
            )
        object.__setattr__(self, "layout", layout)
        for name, default in own.items():
            object.__setattr__(self, name, values.get(name, default))
        check_choice("method", self.method, ("full", "lora", "qlora"))
        check_choice("base_dtype", self.base_dtype, DTYPES)
        check_choice("device", self.device, ("cuda", "cpu"))
        check_choice("optimizer", self.optimizer, ("adamw", "adamw_8bit", "sgd"))
        for name in ("seq_len", "micro_batch_size", "gradient_accumulation_steps"):
            check_positive_int(name, getattr(self, name))
        self._set_lora()

    def _set_lora(self) -> None:
        """The LoRA of a LoRA method (a dict from :meth:`to_dict` read back; the recipes' when not given)."""
        lora = self.lora
        if isinstance(lora, dict):
            lora = LoraSpec.from_dict(lora)
        if self.method == "full" and lora is not None:
            raise ValueError("method='full' trains every weight, but a LoRA was given; pass method='lora'")
        if self.method != "full" and lora is None:
            lora = LoraSpec()
        if lora is not None and not isinstance(lora, LoraSpec):
            raise ValueError(f"lora must be a LoraSpec or its dict, got {type(lora).__name__}")
        object.__setattr__(self, "lora", lora)

    def untraceable_reason(self) -> str | None:
        """Why this layout cannot be traced on this machine, or None. Each reason was found by trying
        (docs/planner.md, "Tracing"); the analytic estimate stands for these layouts."""
        deepspeed = self.layout.strategy.engine is Engine.DEEPSPEED
        reason = _deepspeed_layout_reason(self) if deepspeed else None
        if reason:
            return reason
        reason = self._layout_reason()
        if reason or not deepspeed:
            return reason
        from hf_dist.tracing.zero_shims import installed_version, version_reason

        return version_reason(installed_version())  # last: a layout no DeepSpeed version traces says so first

    def _layout_reason(self) -> str | None:
        """Why no installed library version traces this layout, or None."""
        if self.method == "qlora":
            return "QLoRA: bitsandbytes' 4-bit weights and kernels are CUDA-only and have no fake-tensor kernels"
        if self.optimizer == "adamw_8bit":
            return "8-bit AdamW: bitsandbytes' optimizer kernels are CUDA-only"
        if self.fused_lm_head:
            return "TRL's fused LM head: a Triton kernel, whose CPU fallback holds temporaries the GPU does not"
        if self.use_liger_kernel and (version_refusal() or self.tp_size > 1):
            return version_refusal() or (
                "Liger kernels with tensor parallelism: Liger gathers DTensor inputs (full_tensor), which the fake "
                "Liger functions do not copy"
            )
        if self.offload != "none":
            return "CPU offload: the trace runs on CPU tensors, where offloaded and device memory cannot be told apart"
        if self.cp_size > 1:
            return "context parallelism: torch's context_parallel has no sharding rule for the CPU attention kernel"
        if self.tp_size > 1 and not _transformers_distributes_meta_models():
            return (
                "tensor parallelism: this transformers cannot apply a TP plan to a weightless model "
                "(maybe_distribute_model, transformers >= 5.23)"
            )
        if self.tp_size > 1 and self.method != "full":
            return "LoRA with tensor parallelism: PEFT's LoRA layers do not run on DTensor-sharded weights"
        return None

    def estimate_kwargs(self) -> dict[str, Any]:
        """The same run as :func:`hf_dist.planning.memory.estimate_memory` keywords (after the model and strategy),
        so traced and modelled memory always describe one layout."""
        from hf_dist.planning.features import installed_features

        sixteen = self.mixed_precision != "no"
        return dict(
            world_size=self.world_size, nodes=self.nodes, method=self.method, offload=self.offload,
            optimizer=self.optimizer, master_weights=not self.pure_bf16, param_bytes=2 if sixteen else 4,
            seq_len=self.seq_len, micro_batch_size=self.micro_batch_size,
            activation_checkpointing=self.activation_checkpointing, lora=self.lora,
            gradient_accumulation_steps=self.gradient_accumulation_steps, use_liger_kernel=self.use_liger_kernel,
            attention=self.attention, device=self.device, base_bytes=4 if self.base_dtype == "float32" else 2,
            tp_size=self.tp_size, cp_size=self.cp_size, sp_size=self.sp_size,
            checkpoint_children=installed_features().fsdp2_checkpoints_children,  # the accelerate the trace runs
            fsdp2_embedding_unit=installed_features().fsdp2_embedding_unit,
            fused_lm_head=self.fused_lm_head, sync_each_batch=self.sync_each_batch,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The wire format: the layout's fields flat, then the run's (what :meth:`from_dict` reads back)."""
        run = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layout"}
        lora = self.lora.to_dict() if self.lora is not None else None
        return {**{k: getattr(self, k) for k in LAYOUT_KEYWORDS}, **run, "lora": lora}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceSetup:
        known = set(LAYOUT_KEYWORDS) | {f.name for f in fields(cls)} - {"layout"}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_plan(cls, plan: Any, candidate: Any = None, **overrides: Any) -> TraceSetup:
        """The setup of ``plan``'s chosen layout, or of one of its ``candidate`` alternatives."""
        c = candidate or plan
        accumulation = plan.gradient_accumulation_steps
        if candidate is not None:
            dp = candidate.key.layout(plan.hardware).dp_size
            accumulation = max(plan.global_batch_size // (candidate.micro_batch_size * dp), 1)
        pb = "float32" if plan.mixed_precision == "no" else "bfloat16"
        values = dict(
            strategy=c.strategy, world_size=plan.world_size, nodes=plan.nodes, method=plan.method,
            seq_len=plan.seq_len, micro_batch_size=c.micro_batch_size, gradient_accumulation_steps=accumulation,
            activation_checkpointing=c.activation_checkpointing, mixed_precision=plan.mixed_precision,
            pure_bf16=plan.pure_bf16, base_dtype=plan.model_dtype or pb, lora=plan.lora,
            offload=c.offload, offload_device=c.offload_device, use_liger_kernel=c.use_liger_kernel,
            tp_size=c.tp_size, cp_size=c.cp_size, sp_size=c.sp_size, device=plan.hardware.device,
            optimizer=plan.optimizer, fused_lm_head=plan.fused_lm_head, sync_each_batch=c.sync_each_batch,
        )  # fmt: skip
        values.update(overrides)
        return cls(**values)


def _transformers_distributes_meta_models() -> bool:
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "maybe_distribute_model") and hasattr(PreTrainedModel, "prepare_distribute_model")


def _deepspeed_layout_reason(setup: TraceSetup) -> str | None:
    """Why this DeepSpeed layout cannot be traced by any DeepSpeed version (the engine itself runs under
    :mod:`hf_dist.tracing.zero`; the installed version is checked after every layout reason)."""
    if setup.tp_size > 1 or setup.sp_size > 1:
        return (
            "DeepSpeed AutoTP and Ulysses sequence parallelism: their process groups and sharded layers are not "
            "traced (only ZeRO-1/2/3 over the data-parallel ranks is)"
        )
    if setup.mixed_precision == "fp16":
        return (
            "DeepSpeed fp16: its loss scaler skips steps on overflow, which the tracing shims do not cover (they "
            "answer bf16 and fp32 steps), and DeepSpeed's CPU accelerator refuses fp16 on most CPUs"
        )
    return None
