"""From source tensor names to output tensor names: the conversion plan, validated before any write.

Pure apart from reading ``config.json`` and, for architectures not in :mod:`param_specs`, instantiating
the model on the ``meta`` device to learn the expected names and shapes (no weights are allocated).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.conversion import transform
from hf_dist.checkpoint.formats.reader import TensorSpec


@dataclass
class OutputTensor:
    """One output tensor: the source names it is built from and, for merges, how."""

    sources: list[str]
    shape: tuple[int, ...]
    stored_dtype: Any
    merge: transform.LoraMerge | None = None


@dataclass
class ConversionPlan:
    tensors: dict[str, OutputTensor] = field(default_factory=dict)
    dropped_tied: list[str] = field(default_factory=list)
    kind: str = "model"  # "model" | "adapter"


def expected_specs(
    config_dir: Path, *, trust_remote_code: bool = False
) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Names -> shapes of the model the config describes, and its tied ``target -> source`` keys.

    The config's ``auto_map`` classes are imported only with ``trust_remote_code=True``; without it a registered
    model type is read with transformers' own class and any other config naming code raises
    :class:`~hf_dist.planning.remote_code.RemoteCodeError` (:mod:`hf_dist.planning.remote_code`).
    """
    from hf_dist.checkpoint.formats.hf import load_config_dict
    from hf_dist.checkpoint.formats.param_specs import llama_like_specs
    from hf_dist.planning.remote_code import auto_map_entry, check_trust_flag

    data = load_config_dict(Path(config_dir))
    folder_class = check_trust_flag(trust_remote_code) and auto_map_entry(data, "AutoModelForCausalLM")
    known = None if folder_class else llama_like_specs(data)  # a trusted folder class may name its tensors itself
    if known is not None:
        return known
    from hf_dist.planning.model_source import load_config, meta_model

    model = meta_model(load_config(str(config_dir), trust_remote_code=trust_remote_code),
                       trust_remote_code=trust_remote_code)  # fmt: skip
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    return shapes, tied


def is_peft(specs: dict[str, TensorSpec]) -> bool:
    return any(name.startswith(transform.PEFT_PREFIX) or transform.is_lora_name(name) for name in specs)


def model_plan(
    specs: dict[str, TensorSpec], expected: dict[str, tuple[int, ...]], tied: dict[str, str]
) -> ConversionPlan:
    """Full-model output: wrapper prefixes removed, tied copies dropped, checked against the config."""
    plan = ConversionPlan()
    outer = transform.choose_outer_prefix(specs, set(expected))
    for name, spec in specs.items():
        out = transform.rename(name, outer)
        if out in plan.tensors:
            raise ValueError(f"two source tensors map to {out!r} ({plan.tensors[out].sources[0]} and {name})")
        plan.tensors[out] = OutputTensor([name], spec.shape, spec.dtype)
    _drop_tied(plan, tied)
    validate(plan, expected, tied)
    return plan


def merged_plan(specs: dict[str, TensorSpec], expected, tied, adapter_config: dict) -> ConversionPlan:
    """PEFT checkpoint -> base model with every LoRA pair merged into its base weight."""
    merge = transform.LoraMerge.from_adapter_config(adapter_config)
    plan = ConversionPlan()
    lora = {n for n in specs if transform.is_lora_name(n)}
    outer = transform.choose_outer_prefix(
        [transform.base_key(transform.strip_wrappers(n)) for n in specs], set(expected)
    )
    for name, spec in specs.items():
        if name in lora:
            continue
        clean = transform.strip_wrappers(name)
        out = transform.rename(transform.base_key(clean), outer)
        module = clean[: -len(".weight")].replace(".base_layer", "") if clean.endswith(".base_layer.weight") else None
        pair = _lora_pair(module, lora) if module else None
        plan.tensors[out] = OutputTensor(
            [name, *pair] if pair else [name], spec.shape, spec.dtype, merge if pair else None
        )
    _drop_tied(plan, tied)
    validate(plan, expected, tied)
    return plan


def _lora_pair(module: str, lora: set[str]) -> list[str] | None:
    a = [n for n in lora if transform.strip_wrappers(n).startswith(module + ".lora_A.") and n.endswith(".weight")]
    b = [n for n in lora if transform.strip_wrappers(n).startswith(module + ".lora_B.") and n.endswith(".weight")]
    if len(a) > 1 or len(b) > 1:
        raise ValueError(f"{module} has several adapters ({a}); --merge-adapter supports one adapter per checkpoint")
    return [a[0], b[0]] if a and b else None


def adapter_plan(specs: dict[str, TensorSpec]) -> ConversionPlan:
    """PEFT checkpoint -> adapter weights only, named as PEFT's ``save_pretrained`` names them."""
    plan = ConversionPlan(kind="adapter")
    for name, spec in specs.items():
        if transform.is_lora_name(name) or ".modules_to_save." in name:
            out = transform.adapter_key(transform.strip_wrappers(name))
            plan.tensors[out] = OutputTensor([name], spec.shape, spec.dtype)
    if not plan.tensors:
        raise ValueError("--adapter was given but the checkpoint has no LoRA tensors (no '.lora_A.' names)")
    return plan


def _drop_tied(plan: ConversionPlan, tied: dict[str, str]) -> None:
    for target, source in tied.items():
        if target in plan.tensors and source in plan.tensors:
            del plan.tensors[target]
            plan.dropped_tied.append(target)


def validate(plan: ConversionPlan, expected: dict[str, tuple[int, ...]], tied: dict[str, str]) -> None:
    """Every expected parameter exactly once with the config's shape; nothing unexpected."""
    wanted = {k: v for k, v in expected.items() if k not in tied}
    missing = sorted(set(wanted) - set(plan.tensors))
    extra = sorted(set(plan.tensors) - set(expected))
    wrong = [f"{k}: checkpoint {plan.tensors[k].shape} vs config {wanted[k]}" for k in wanted
             if k in plan.tensors and plan.tensors[k].shape != wanted[k]]  # fmt: skip
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameters missing from the checkpoint: {missing[:5]}")
    if extra:
        problems.append(f"{len(extra)} tensors not in the model the config describes: {extra[:5]}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatches: {wrong[:3]}")
    if problems:
        raise ValueError(
            "checkpoint does not match the model config: "
            + "; ".join(problems)
            + ". Pass the config of the trained model with --model-config DIR"
        )
