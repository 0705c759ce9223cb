"""Which module classes FSDP should wrap (one FSDP unit each) for any Hugging Face model.

The answer is the decoder-layer class: ``LlamaDecoderLayer``, ``GPT2Block``, ``Phi3DecoderLayer``...
It comes from the model's own ``_no_split_modules`` when those names are really present in the
module tree (some models list classes they never instantiate), otherwise from the block class
repeated in the model's largest ``nn.ModuleList``. PEFT wrappers (``PeftModel``, ``LoraModel``)
are looked through: LoRA layers live inside the decoder layers, so the wrap class is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["fsdp_wrap_classes", "block_candidates"]


def fsdp_wrap_classes(
    model: Any, requested: Iterable[str] | None = None, *, trust_remote_code: bool = False
) -> list[str]:
    """Return the class names FSDP should wrap for ``model``.

    ``model`` is an ``nn.Module`` (PEFT-wrapped too), a ``PretrainedConfig``, a config dict with
    ``model_type``, or a local folder / ``config.json`` / hub name (a config is built on the meta
    device, so no weights are allocated). ``requested`` overrides detection; each name must be a
    class present in the model, otherwise a ``ValueError`` lists the candidates found. A config's ``auto_map``
    classes are imported only with ``trust_remote_code=True`` (:mod:`hf_dist.planning.remote_code`).

    >>> fsdp_wrap_classes(LlamaConfig(num_hidden_layers=2, hidden_size=64, ...))
    ['LlamaDecoderLayer']
    """
    module = _as_module(model, trust_remote_code=trust_remote_code)
    present = {type(m).__name__ for m in module.modules()}
    candidates = block_candidates(module)
    if requested is not None:
        requested = [requested] if isinstance(requested, str) else list(requested)
        return _validate_requested(requested, present, candidates, module)

    declared = [name for name in _declared_no_split(module) if name in present]
    if declared:
        return declared
    if candidates:
        return candidates[:1]
    raise ValueError(
        f"Could not find a repeated block to wrap in {type(module).__name__}: it declares no "
        "`_no_split_modules` present in the model and has no nn.ModuleList of identical blocks. "
        "Pass the decoder-layer class name explicitly, e.g. fsdp_wrap_classes(model, ['MyDecoderLayer'])."
    )


def block_candidates(module: Any) -> list[str]:
    """Classes repeated in the model's ``nn.ModuleList``s, largest list (by parameter count) first."""
    import torch.nn as nn

    scored: dict[str, int] = {}
    for child in module.modules():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        names = {type(block).__name__ for block in child}
        if len(names) != 1:
            continue
        # numel() works on meta tensors, so this costs nothing for a config-built model.
        size = sum(p.numel() for p in child.parameters())
        name = names.pop()
        scored[name] = max(scored.get(name, 0), size)
    return sorted(scored, key=lambda n: -scored[n])


def _validate_requested(requested: list[str], present: set[str], candidates: list[str], module: Any) -> list[str]:
    if not requested:
        raise ValueError(
            "requested wrap classes is an empty list; pass None to auto-detect or at least one class name."
        )
    missing = [name for name in requested if name not in present]
    if missing:
        found = list(dict.fromkeys([n for n in _declared_no_split(module) if n in present] + candidates))
        raise ValueError(
            f"FSDP wrap class(es) {missing} not found in {type(module).__name__}. "
            f"Candidates found in this model: {found or 'none'}. Use one of them, or pass None to auto-detect."
        )
    return list(dict.fromkeys(requested))


def _declared_no_split(module: Any) -> list[str]:
    """``_no_split_modules`` of every transformers model inside ``module`` (PEFT wrappers included)."""
    names: list[str] = []
    for child in module.modules():
        declared = getattr(type(child), "_no_split_modules", None)
        if declared:
            names.extend(declared)
    return list(dict.fromkeys(names))


def _as_module(model: Any, *, trust_remote_code: bool) -> Any:
    import torch.nn as nn

    from hf_dist.planning.model_source import meta_model, resolve_config

    if isinstance(model, nn.Module):
        return model
    return meta_model(resolve_config(model, trust_remote_code=trust_remote_code), trust_remote_code=trust_remote_code)
