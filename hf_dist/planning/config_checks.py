"""The config fields the planner reads, checked before anything is built: sizes, head layout, dtype, RoPE, the
layer cap; and the sequence length a plan or a run may use (the model's positions)."""

from __future__ import annotations

import sys
from typing import Any

MAX_LAYERS = 10_000  # far past any released model (hundreds); 200,000 layers took over 90 s to build on meta


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# torch's floating dtypes by name, so a config.json is checked without importing torch; any other name asks torch
FLOAT_DTYPE_NAMES = frozenset({"bfloat16", "double", "float", "float16", "float32", "float64", "half"})


def _dtype_problem(value: Any) -> bool:
    loaded = sys.modules.get("torch")  # a torch.dtype object means torch is imported
    if value is None or (loaded is not None and isinstance(value, loaded.dtype)):
        return False
    if not isinstance(value, str):
        return True
    name = value.removeprefix("torch.")
    if name == "auto" or name in FLOAT_DTYPE_NAMES:
        return False
    import torch

    return not (isinstance(getattr(torch, name, None), torch.dtype) and getattr(torch, name).is_floating_point)


def _rope_thetas(get: Any) -> list[Any]:
    """``rope_theta`` where a config keeps it: top level (transformers 4), ``rope_parameters`` (one dict, or one per
    layer type: transformers 5)."""
    thetas = [get("rope_theta")]
    params = get("rope_parameters")
    for part in (params.values() if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values())
                 else [params]):  # fmt: skip
        if isinstance(part, dict):
            thetas.append(part.get("rope_theta"))
    return [theta for theta in thetas if theta is not None]


def config_field_problem(get: Any, dtype_keys: tuple[str, ...] = ("dtype", "torch_dtype")) -> str | None:
    """What is wrong with the config fields the planner reads beyond the sizes (``get(key)``: the value or None), or
    None: the layer count under :data:`MAX_LAYERS`, ``head_dim`` and ``max_position_embeddings`` positive integers,
    ``tie_word_embeddings`` a boolean, ``dtype`` a torch floating dtype, ``rope_theta`` a finite positive number."""
    import math

    layers = get("num_hidden_layers")
    if _positive_int(layers) and layers > MAX_LAYERS:
        return (f"num_hidden_layers {layers} is over hf_dist's cap of {MAX_LAYERS:,} layers (released models have "
                "hundreds); nothing was built")  # fmt: skip
    for key in ("head_dim", "max_position_embeddings"):
        value = get(key)
        if value is not None and not _positive_int(value):
            return f"{key} must be a positive integer, got {value!r}"
    tie = get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        return f"tie_word_embeddings must be true or false, got {tie!r}"
    for key in dtype_keys:
        if _dtype_problem(get(key)):
            return f"{key} must name a torch floating dtype (bfloat16, float16, float32), got {get(key)!r}"
    for theta in _rope_thetas(get):
        number = isinstance(theta, (int, float)) and not isinstance(theta, bool)
        if not number or not math.isfinite(theta) or theta <= 0:
            return f"rope_theta must be a finite positive number, got {theta!r}"
    return None


def check_config_dict(data: dict, *, where: str) -> None:
    """Refuse a raw config.json (and its ``text_config``) whose fields the planner reads are of the wrong type or
    range, in one line, before transformers builds anything from it (its own validators raise tracebacks)."""
    for part, label in ((data, where), (data.get("text_config"), f"{where} (text_config)")):
        if not isinstance(part, dict):
            continue
        layers = part.get("num_hidden_layers")
        if layers is not None and not _positive_int(layers):
            raise ValueError(f"{label}: num_hidden_layers must be a positive integer, got {layers!r}; fix config.json")
        problem = config_field_problem(part.get)
        if problem is not None:
            raise ValueError(f"{label}: {problem}; fix config.json")


def check_dimensions(config: Any, *, name: str | None = None) -> None:
    """Refuse a config whose sizes are zero, negative, non-integer or inconsistent, before anything is planned."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    where = f"model config {name or getattr(config, '_name_or_path', '') or config.model_type}".rstrip()
    sizes = {key: getattr(text, key, None) for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                        "vocab_size", "intermediate_size", "num_key_value_heads")}  # fmt: skip
    for key, value in sizes.items():
        required = key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
        if value is None and not required:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}; fix config.json")
    problem = config_field_problem(lambda key: getattr(text, key, None), ("dtype",))
    if problem is not None:
        raise ValueError(f"{where}: {problem}; fix config.json")
    hidden, heads, kv = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    head_dim = getattr(text, "head_dim", None)
    # transformers 5.0 fills head_dim = hidden // heads itself: only an explicit, different head_dim is a choice
    if hidden % heads and (head_dim is None or head_dim == hidden // heads):
        raise ValueError(
            f"{where}: hidden size ({hidden}) is not a multiple of num_attention_heads ({heads}) and no head_dim is "
            f"given; fix config.json (e.g. num_attention_heads that divides {hidden}, or an explicit head_dim)"
        )
    if kv is not None and heads % kv:
        raise ValueError(
            f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv}); fix config.json"
        )


def position_limit(config: Any) -> int | None:
    """The longest sequence ``config`` (a transformers config, or anything with ``max_position_embeddings``) was
    trained for: its ``max_position_embeddings``, None when unknown or when it scales RoPE (``rope_scaling`` /
    ``rope_parameters`` with a ``rope_type`` other than ``default``: the scaling decides how far it reaches)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1 or _scales_rope(text):
        return None
    return limit


def _scales_rope(text: Any) -> bool:
    """Whether a text config scales RoPE; transformers 5 keeps ``rope_parameters`` (one dict, or one per layer type)
    with ``rope_type: default`` when nothing is scaled, older ones ``rope_scaling`` (None then)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = getattr(text, key, None)
        per_layer_type = isinstance(value, dict) and all(isinstance(v, dict) for v in value.values())
        params = value.values() if per_layer_type else [value]
        if any(isinstance(p, dict) and p.get("rope_type", p.get("type", "default")) != "default" for p in params):
            return True
    return False


DEFAULT_SEQ_LEN = 2048  # what a plan is for when no sequence length is given (the model's positions if fewer)


def resolve_seq_len(seq_len: int | None, config: Any, *, default: int = DEFAULT_SEQ_LEN, name: str = "seq_len") -> int:
    """The sequence length to plan or train with: ``seq_len`` checked against the model's positions
    (:func:`check_seq_len`), or, when None, ``default`` capped at its ``max_position_embeddings``."""
    if seq_len is not None:
        check_seq_len(seq_len, config, name=name)
        return seq_len
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    usable = isinstance(positions, int) and not isinstance(positions, bool) and positions >= 1
    return min(default, positions) if usable else default


def check_seq_len(seq_len: int, config: Any, *, name: str = "seq_len") -> None:
    """Refuse a ``seq_len`` beyond the positions ``config`` has (:func:`position_limit`), in one line naming both
    numbers and the fix; ``name``: the keyword or flag the user gave it under (the recipes' ``--max_seq_length``)."""
    limit = position_limit(config)
    if limit is not None and seq_len > limit:
        raise ValueError(
            f"{name} {seq_len} exceeds the model's max_position_embeddings={limit} (its config scales no RoPE); "
            f"use {name} <= {limit}, or a model (or rope_scaling) with longer context"
        )
