"""A config factory called with a :class:`~hf_dist.planning.layout.Layout` instead of a strategy name.

``deepspeed_config(plan.layout)``, ``fsdp_config(layout)`` and ``accelerate_config(layout)`` read every keyword the
layout holds from it, so a plan's layout reaches each format whole, and the strategy is looked up once (the Layout
did). A keyword passed beside the Layout with another value than the layout's is refused, naming both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hf_dist.planning.layout import Layout

# the keywords of each factory that a Layout holds, by the Layout's names (but num_processes: its world_size)
DEEPSPEED_FIELDS = ("offload", "mixed_precision", "pure_bf16", "tp_size", "sp_size", "offload_device")
FSDP_FIELDS = ("offload", "activation_checkpointing", "mixed_precision")
ACCELERATE_FIELDS = (
    "offload", "nodes", "mixed_precision", "activation_checkpointing", "tp_size", "cp_size", "sp_size",
    "offload_device", "num_processes",
)  # fmt: skip
_ATTRIBUTE = {"num_processes": "world_size"}


def layout_kwargs(
    factory: Callable[..., Any], layout: Layout, passed: Mapping[str, Any], keywords: tuple[str, ...]
) -> dict[str, Any]:
    """``{keyword: the layout's value}`` for ``factory``'s ``keywords``. ``passed``: the factory's arguments as called;
    a keyword left at its default takes the layout's value, one passed with another value than the layout's is
    refused."""
    defaults = factory.__kwdefaults__  # the keywords are keyword-only
    out = {}
    for keyword in keywords:
        held = getattr(layout, _ATTRIBUTE.get(keyword, keyword))
        given = passed[keyword]
        if given != defaults[keyword] and given != held:
            raise ValueError(
                f"{factory.__name__}() was given a Layout that holds {keyword}={held!r} and also {keyword}={given!r}; "
                f"drop {keyword}= (the layout's value is used), or build the Layout with {keyword}={given!r}"
            )
        out[keyword] = held
    return out
