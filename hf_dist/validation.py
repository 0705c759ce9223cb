"""Checks of user input, one wording everywhere: what was received, what is allowed, what to do."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_choice(name: str, value: Any, allowed: Iterable[Any], hint: str = "") -> Any:
    """Return ``value`` if it is one of ``allowed``, else raise a ValueError naming the allowed values."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(
            f"unknown {name} {value!r}; allowed: {', '.join(map(str, allowed))}.{(' ' + hint) if hint else ''}"
        )
    return value


def check_positive_int(name: str, value: Any, hint: str = "") -> int:
    """Return ``value`` if it is an int >= 1 (not a bool), else raise a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.{(' ' + hint) if hint else ''}")
    return value


def check_number(name: str, value: Any, *, minimum: float | None = None, above: float | None = None,
                 hint: str = "") -> float:  # fmt: skip
    """Return ``value`` if it is a finite real number within the bounds, else raise a ValueError naming it.

    NaN and +-inf are refused everywhere: they pass or fail comparisons silently (``nan > 0`` is False,
    ``inf`` memory "fits" anything).
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (minimum is None or value >= minimum) and (above is None or value > above)
    if not ok:
        bound = f" > {above:g}" if above is not None else f" >= {minimum:g}" if minimum is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}.{(' ' + hint) if hint else ''}")
    return value


def restrict(name: str, value: Any, allowed: tuple) -> tuple:
    """``allowed`` when ``value`` is None (search them all), else ``(value,)`` once checked."""
    if value is None:
        return allowed
    return (check_choice(name, value, allowed),)


def raise_contradictions(problems: Iterable[str], what: str = "auto_args") -> None:
    """Raise one ``ValueError`` listing every problem in ``problems`` (its ``problems`` attribute holds them), or
    return when there is none. With one problem the message is that problem; several are numbered, so a user fixes
    them in one pass instead of one per run."""
    problems = list(problems)
    if not problems:
        return
    message = problems[0]
    if len(problems) > 1:
        lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
        message = f"{what}: {len(problems)} contradictions, fix them all:\n{lines}"
    error = ValueError(message)
    error.problems = problems
    raise error
