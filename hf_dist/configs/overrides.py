"""User overrides of the strategy's own ``TrainingArguments`` keys, checked against the plan.

``auto_args(..., fsdp=..., fsdp_config=..., deepspeed=..., parallelism_config=..., accelerator_config=...)``: the
generated FSDP config / DeepSpeed JSON is
the base, the user's nested dict is merged into it key by key, and a key that contradicts the plan is an
error naming both values and the fix. Turning the planned engine off (``fsdp=False`` with an FSDP plan,
``deepspeed=None`` with a ZeRO plan) or switching it on against the plan is an error too: the strategy is
chosen with ``strategy=``, which also re-plans memory, never by a side door.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hf_dist.planning.layout import strategy as registry_entry

__all__ = ["apply_strategy_overrides", "merge_nested"]

# Generated values the consumer fills in later; a user value there is not a contradiction.
_FILLED_LATER = ("auto",)
_MISSING = object()
# DeepSpeed keys whose absence in the generated config is the plan's choice "off", and whether a value turns it on.
_ABSENT_MEANS_OFF = {
    "offload_optimizer": lambda v: _device(v) != "none",
    "offload_param": lambda v: _device(v) != "none",
    "tensor_parallel": lambda v: int((v or {}).get("autotp_size", 1) if isinstance(v, dict) else 1) > 1,
    "sequence_parallel_size": lambda v: int(v or 1) > 1,
}
# ParallelismConfig sizes: the plan's value of each (1 where the generated config leaves it out).
_MESH_SIZES = ("tp_size", "cp_size", "sp_size", "dp_replicate_size", "dp_shard_size")  # the model-parallel first


def apply_strategy_overrides(plan: Any, ours: dict[str, Any], user: dict[str, Any]) -> list[str]:
    """Fold ``user``'s ``fsdp``/``fsdp_config``/``deepspeed`` into ``ours`` (both mutated); return the keys that
    contradict the plan, each as a message with its fix (where one does, the plan's value is kept)."""
    strategy = plan.strategy
    s = registry_entry(strategy)
    conflicts = _engine_flag_conflicts(strategy, "fsdp", user, ours, s.is_fsdp)
    conflicts += _engine_flag_conflicts(strategy, "deepspeed", user, ours, s.is_deepspeed)
    given = user.pop("fsdp_config", None)
    if given is not None and not s.is_fsdp:
        conflicts.append(
            f"fsdp_config={given!r} was given but the plan's strategy is {strategy!r}, not FSDP; pass "
            "strategy='fsdp_full_shard' (or 'fsdp_shard_grad_op') to train with FSDP, or drop fsdp_config."
        )
    elif given is not None:
        given = {_fsdp_key(k): v for k, v in _as_dict("fsdp_config", given).items()}
        ours["fsdp_config"] = merge_nested(ours["fsdp_config"], given, "fsdp_config", strategy, conflicts)
    if user.get("deepspeed") and s.is_deepspeed:
        given = _as_dict("deepspeed", user.pop("deepspeed"))
        ours["deepspeed"] = merge_nested(ours["deepspeed"], given, "deepspeed", strategy, conflicts)
    if user.get("parallelism_config") is not None:
        conflicts += _mesh_conflicts(plan, ours, user)
    if user.get("accelerator_config") is not None:
        conflicts += _accelerator_config_conflicts(plan, ours, user)
    return conflicts


def _accelerator_config_conflicts(plan: Any, ours: dict[str, Any], user: dict[str, Any]) -> list[str]:
    """A user ``accelerator_config`` (dict, JSON file or transformers ``AcceleratorConfig``) keeps the plan's
    ``gradient_accumulation_kwargs.sync_each_batch``: it decides whether FSDP2 holds every unsharded gradient until
    the last micro-batch, which the plan's memory counts. The user's other keys are merged into the generated ones."""
    given = user["accelerator_config"]
    if hasattr(given, "to_dict"):
        given = given.to_dict()
    given = _as_dict("accelerator_config", given)
    planned = bool(getattr(plan, "sync_each_batch", False))
    kwargs = given.get("gradient_accumulation_kwargs") or {}
    asked = kwargs.get("sync_each_batch", _MISSING)
    conflicts = []
    if asked is not _MISSING and bool(asked) != planned and (planned or plan.gradient_accumulation_steps > 1):
        conflicts.append(
            f"accelerator_config gradient_accumulation_kwargs sync_each_batch={asked!r} contradicts the plan "
            f"({plan.strategy}, sync_each_batch={planned}): it decides whether FSDP2 keeps every unsharded gradient "
            f"until the last micro-batch; pass sync_each_batch={bool(asked)} to auto_args (a planner keyword, so "
            "memory and speed follow it) and drop it from accelerator_config."
        )
    mine = ours.get("accelerator_config") or {}
    merged_kwargs = {**kwargs, **(mine.get("gradient_accumulation_kwargs") or {})}
    user["accelerator_config"] = {
        **given,
        **({"gradient_accumulation_kwargs": merged_kwargs} if merged_kwargs else {}),
    }
    return conflicts


def _mesh_conflicts(plan: Any, ours: dict[str, Any], user: dict[str, Any]) -> list[str]:
    """A user ``parallelism_config`` (dict or accelerate ``ParallelismConfig``) must give the plan's mesh sizes: a
    size the plan did not choose would shard the model and split the batch other than the memory and batch math
    assumed. Consistent, it replaces the generated one (a dict is merged into it)."""
    given = user["parallelism_config"]
    sizes = given if isinstance(given, dict) else {k: getattr(given, k, None) for k in _MESH_SIZES}
    layout = plan.layout
    planned = {k: getattr(layout, k) for k in _MESH_SIZES}
    if layout.strategy.is_deepspeed:  # AutoTP lives in the DeepSpeed JSON, not in the mesh
        planned["tp_size"] = 1
    conflicts = [
        f"parallelism_config {key}={sizes[key]} contradicts the plan ({plan.strategy}, {key} {planned[key]}): "
        f"{_MESH_FIX[key]} and drop it from parallelism_config (the plan writes the mesh)."
        for key in _MESH_SIZES
        if sizes.get(key) is not None and int(sizes[key]) != planned[key]
    ]
    if isinstance(given, dict):
        user["parallelism_config"] = {**(ours.get("parallelism_config") or {}), **given}
    return conflicts


_MESH_FIX = {
    "dp_replicate_size": "pass strategy='hsdp' (replicas across nodes) or another strategy to auto_args",
    "dp_shard_size": "the shard size follows the GPU count and the other sizes; pass gpus=/nodes=/tp_size= instead",
    "tp_size": "pass tp_size= to auto_args (a planner keyword, so memory and batch follow it)",
    "cp_size": "pass cp_size= to auto_args (a planner keyword, so memory and batch follow it)",
    "sp_size": "pass sp_size= to auto_args (a planner keyword, so memory and batch follow it)",
}


def _engine_flag_conflicts(
    strategy: str, key: str, user: dict[str, Any], ours: dict[str, Any], planned: bool
) -> list[str]:
    """``fsdp=``/``deepspeed=`` given by the user against the plan's engine (a contradicting flag is dropped: the
    plan's engine config stays)."""
    if key not in user:
        return []
    value = user[key]
    other = "strategy='zero3' (or zero1/zero2)" if key == "deepspeed" else "strategy='fsdp_full_shard'"
    if planned and not value:
        user.pop(key)
        return [
            f"{key}={value!r} turns off the engine of strategy {strategy!r} that the plan uses; drop {key}={value!r} "
            f"to keep {strategy}, or pass strategy='ddp' (or another strategy) to train without it."
        ]
    if not planned and value:
        user.pop(key)
        return [
            f"{key}={_short(value)} asks for {'DeepSpeed' if key == 'deepspeed' else 'FSDP'} but the plan's strategy "
            f"is {strategy!r}; pass {other} so the plan (memory, batch split) matches, and give only the keys you "
            "want to change: they are merged into the generated config."
        ]
    if not planned:  # False/None on a plan without that engine: consistent, nothing to add
        user.pop(key)
        return []
    if key == "fsdp":
        user.pop(key)
        return _fsdp_flag_conflicts(strategy, value, ours)
    return []


def _fsdp_flag_conflicts(strategy: str, value: Any, ours: dict[str, Any]) -> list[str]:
    """``fsdp=True`` or the legacy string/list form: its words must agree with the plan."""
    if value is True:
        return []
    words = set(value.split() if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [])
    mode = registry_entry(strategy).fsdp_mode
    modes = words & {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard"}
    conflicts = []
    if modes - {mode}:
        conflicts.append(
            f"fsdp={value!r} asks for {sorted(modes)} but the plan's strategy is {strategy!r} ({mode}); pass "
            f"strategy= with the one you want (fsdp_full_shard, fsdp_shard_grad_op, hsdp) and fsdp=True."
        )
    offload = bool(ours["fsdp_config"].get("cpu_offload"))
    if ("offload" in words) != offload:
        conflicts.append(
            f"fsdp={value!r} {'asks for' if 'offload' in words else 'leaves out'} CPU offload but the plan has "
            f"offload {'on' if offload else 'off'}; pass offload='optimizer+params' (or 'none') to auto_args instead."
        )
    return conflicts


def merge_nested(
    ours: dict[str, Any], given: dict[str, Any], where: str, strategy: str, conflicts: list[str]
) -> dict[str, Any]:
    """``ours`` with ``given`` merged in key by key (recursively); a key set to another value keeps the plan's and
    is added to ``conflicts``."""
    merged = dict(ours)
    for key, value in given.items():
        mine = ours.get(key, _MISSING)
        path = f"{where}[{key!r}]"
        if mine is _MISSING and key in _ABSENT_MEANS_OFF and _ABSENT_MEANS_OFF[key](value):
            conflicts.append(
                f"{path}={value!r} contradicts the plan ({strategy}), which leaves it off ({path} absent). "
                f"{_fix(key, strategy)}"
            )
        elif mine is _MISSING or mine in _FILLED_LATER or _same(mine, value):
            merged[key] = value
        elif isinstance(mine, dict) and isinstance(value, dict):
            merged[key] = merge_nested(mine, value, path, strategy, conflicts)
        else:
            conflicts.append(
                f"{path}={value!r} contradicts the plan ({strategy}), which sets {path}={mine!r}. {_fix(key, strategy)}"
            )
    return merged


def _device(section: Any) -> str:
    return str(section.get("device", "none") if isinstance(section, dict) else section).lower()


def _fix(key: str, strategy: str) -> str:
    fixes = {
        "stage": "Pass strategy='zero1'/'zero2'/'zero3' for the stage you want (the plan then checks it fits) and "
        "drop the stage key.",
        "cpu_offload": "Pass offload='optimizer+params' (or 'none') to auto_args so the plan accounts for it.",
        "offload_optimizer": "Pass offload='optimizer' (or 'none') to auto_args so the plan accounts for it.",
        "offload_param": "Pass offload='optimizer+params' to auto_args so the plan accounts for it.",
        "tensor_parallel": "Pass tp_size= to auto_args (AutoTP; the plan then splits the batch over the rest).",
        "autotp_size": "Pass tp_size= to auto_args (AutoTP; the plan then splits the batch over the rest).",
        "sequence_parallel_size": "Pass sp_size= to auto_args so memory and the batch split follow it.",
        "transformer_layer_cls_to_wrap": "Pass wrap_classes=[...] to auto_args instead.",
        "activation_checkpointing": "Pass activation_checkpointing=True/False to auto_args (a planner keyword).",
        "reshard_after_forward": "Pass strategy='fsdp_full_shard' (True) or 'fsdp_shard_grad_op' (False).",
        "enabled": "Precision follows bf16=/fp16= (the plan picks by hardware); set those instead.",
    }
    return fixes.get(key, "Drop the key to keep the plan's value, or change the plan's inputs to get yours.")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple, str)):
        return list(a) == ([b] if isinstance(b, str) else list(b))
    if isinstance(a, bool) and isinstance(b, str) and b.lower() in ("true", "false"):
        return a == (b.lower() == "true")
    return a == b


def _fsdp_key(key: str) -> str:
    # TrainingArguments accepts "fsdp_"-prefixed keys and strips the prefix
    return key[len("fsdp_") :] if key.startswith("fsdp_") else key


def _as_dict(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, (str, Path)):
        return read_json_config(name, value)
    raise ValueError(f"{name} must be a dict (or a JSON file path), got {type(value).__name__} {_short(value)}.")


def read_json_config(name: str, value: str | Path) -> dict[str, Any]:
    """The JSON object in file ``value`` (given as ``name``); a clear error when it is unreadable or not an object."""
    try:
        data = json.loads(Path(value).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{name}={str(value)!r} is not a readable JSON file ({exc}); pass a JSON file path."
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{name}={str(value)!r} holds {type(data).__name__} {_short(data)}, not a JSON object.")
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."
