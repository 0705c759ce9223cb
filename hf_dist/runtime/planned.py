"""The plan ``hf_dist.auto_args`` made, carried inside the arguments it returns: where ``attach(trainer)`` finds it.

``auto_args`` returns ``TrainingArguments`` keywords, which ``TrainingArguments(**kwargs)`` (or a subclass, such as
TRL's configs) unpacks field by field. The one field that takes any dict and keeps it, in every layout and every
tested transformers version, is ``fsdp_config``: transformers reads only its own keys from it, and only when FSDP is
on. The plan rides there under :data:`PLAN_KEY`, as a :class:`CarriedPlan`: a small dict that names the plan (what
``print(args)`` and the loggers show), with the :class:`~hf_dist.planning.plan_result.Plan` object beside it.
``attach(trainer)`` reads it back from ``trainer.args``, so two runs planned in one process each check their own.

Copies of the arguments (``copy``, ``deepcopy``, TRL's ``to_dict()`` round trip) keep the plan; pickling them
(``training_args.bin`` in every checkpoint) writes the plain dict, so no hf_dist class is in the file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from hf_dist.planning.plan_result import Plan

PLAN_KEY = "hf_dist_plan"


class CarriedPlan(dict):
    """The plan's name as a dict of plain values, and the plan itself as ``.plan``."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(
            strategy=plan.strategy,
            world_size=plan.world_size,
            micro_batch_size=plan.micro_batch_size,
            gradient_accumulation_steps=plan.gradient_accumulation_steps,
            seq_len=plan.seq_len,
        )
        self.plan = plan

    def __reduce__(self) -> tuple:  # pickled: the plain dict
        return dict, (dict(self),)

    def __copy__(self) -> CarriedPlan:
        return self  # the plan is not changed after planning: a copy of the arguments checks against the same one

    def __deepcopy__(self, memo: dict) -> CarriedPlan:
        return self


def carry(kwargs: dict, plan: Plan) -> dict:
    """``kwargs`` with ``plan`` in their ``fsdp_config`` (a new dict: a user's or the factory's is not changed)."""
    kwargs["fsdp_config"] = {**(kwargs.get("fsdp_config") or {}), PLAN_KEY: CarriedPlan(plan)}
    return kwargs


def carried_plan(args: Any) -> Plan | None:
    """The plan ``auto_args`` put into ``args`` (a ``TrainingArguments``, or the kwargs dict), or None."""
    config = args.get("fsdp_config") if isinstance(args, dict) else getattr(args, "fsdp_config", None)
    carried = config.get(PLAN_KEY) if isinstance(config, dict) else None
    return getattr(carried, "plan", None)
