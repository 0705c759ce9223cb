"""PlanCallback: log the plan at train start and warn where the live job differs from it."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from hf_dist.planning.layout import REGISTRY
from hf_dist.planning.wrap import fsdp_wrap_classes
from hf_dist.runtime import dist as _dist

logger = logging.getLogger(__name__)


def live_setup(args: Any, model: Any = None) -> dict[str, Any]:
    """What the Trainer really runs: strategy, world size, mixed precision and FSDP wrap classes."""
    if getattr(args, "bf16", False):
        precision = "bf16"
    elif getattr(args, "fp16", False):
        precision = "fp16"
    else:
        precision = "no"
    return {
        "strategy": _dist.live_strategy(args),
        "world_size": max(_dist.world_size(), getattr(args, "world_size", 1)),
        "mixed_precision": precision,
        "wrap_classes": _dist.live_wrap_classes(),
    }


def planned_wrap_classes(model: Any) -> list[str] | None:
    """The wrap classes hf_dist would pick for ``model`` (None without a model)."""
    if model is None:
        return None
    return sorted(fsdp_wrap_classes(model))


def plan_mismatches(plan: Any, live: dict[str, Any], planned_wrap: list[str] | None = None) -> list[str]:
    """Human-readable differences between ``plan`` and ``live`` (``live_setup`` output); pure."""
    out = []
    if live["strategy"] != plan.strategy:
        out.append(f"strategy: planned {plan.strategy}, running {live['strategy']}")
    if live["world_size"] != plan.world_size:
        out.append(f"world size: planned {plan.world_size}, running {live['world_size']}")
    from hf_dist.runtime.precision import trainer_mixed_precision

    expected = trainer_mixed_precision(plan)  # pure bf16 FSDP2 runs with bf16=False on purpose
    if live["mixed_precision"] != expected:
        out.append(f"mixed precision: planned {expected}, running {live['mixed_precision']}")
    if planned_wrap is not None and live["wrap_classes"] is not None and live["wrap_classes"] != planned_wrap:
        out.append(f"FSDP wrap classes: planned {planned_wrap}, running {live['wrap_classes']}")
    return out


class PlanCallback(TrainerCallback):
    """Logs ``plan.explain()`` at train start (rank 0) and warns about every difference from the live job.

    The differences are also kept in ``self.mismatches`` (on every rank) so scripts can act on them.
    """

    def __init__(self, plan: Any) -> None:
        if plan is None or not hasattr(plan, "explain"):
            raise ValueError(f"PlanCallback needs an hf_dist.Plan (from hf_dist.plan(...)), got {plan!r}")
        self.plan = plan
        self.mismatches: list[str] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        live = live_setup(args, model)
        planned_wrap = planned_wrap_classes(model) if live["wrap_classes"] is not None else None
        self.mismatches = plan_mismatches(self.plan, live, planned_wrap)
        if not state.is_world_process_zero:
            return
        text = f"hf_dist plan:\n{self.plan.explain()}"
        # The plan is the first thing to read in a job log, whatever the logging level.
        if logger.isEnabledFor(logging.INFO):
            logger.info(text)
        else:
            print(text, flush=True)
        for item in self.mismatches:
            logger.warning("hf_dist: the live setup differs from the plan: %s", item)
        running = REGISTRY.get(live["strategy"])
        if any(m.startswith("strategy") for m in self.mismatches) and running is not None and running.is_ddp:
            logger.warning(
                "hf_dist: running plain DDP; note that accelerate silently drops FSDP on CPU "
                "(use hf_dist's CPU FSDP path or a GPU machine)"
            )
