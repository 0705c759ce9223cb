"""Config factories: a strategy (usually from a :class:`hf_dist.planner.Plan`) becomes
``TrainingArguments`` kwargs, an FSDP config, a DeepSpeed JSON or an accelerate YAML.

Every factory is a pure function of its arguments (no environment, files or process groups),
so the same inputs always give the same config and the shipped YAMLs can be regenerated.
"""

from __future__ import annotations

from hf_dist.memory import ALLOWED_OFFLOADS, OFFLOADS, STRATEGIES

FSDP_STRATEGIES = ("fsdp_full_shard", "fsdp_shard_grad_op", "hsdp")
DEEPSPEED_STRATEGIES = ("zero1", "zero2", "zero3")
MIXED_PRECISIONS = ("bf16", "fp16", "no")

__all__ = [
    "ALLOWED_OFFLOADS",
    "DEEPSPEED_STRATEGIES",
    "FSDP_STRATEGIES",
    "MIXED_PRECISIONS",
    "OFFLOADS",
    "STRATEGIES",
    "check_choice",
    "check_number",
]


def check_choice(name: str, value: object, allowed: tuple[str, ...], hint: str = "") -> str:
    """Return ``value`` if allowed, else raise a ValueError naming the allowed values."""
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}.{(' ' + hint) if hint else ''}")
    return value  # type: ignore[return-value]


def check_number(name: str, value: object, *, minimum: float | None = None, above: float | None = None,
                 hint: str = "") -> float:  # fmt: skip
    """Return ``value`` if it is a finite real number within the bounds, else raise a ValueError naming it.

    NaN and +-inf are refused everywhere: they pass or fail comparisons silently (``nan > 0`` is False,
    ``inf`` memory "fits" anything).
    """
    import math

    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (minimum is None or value >= minimum) and (above is None or value > above)  # type: ignore[operator]
    if not ok:
        bound = f" > {above:g}" if above is not None else f" >= {minimum:g}" if minimum is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}.{(' ' + hint) if hint else ''}")
    return value  # type: ignore[return-value]
