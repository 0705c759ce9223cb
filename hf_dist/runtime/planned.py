"""The plan ``hf_dist.auto_args`` made in this process: where ``hf_dist.callbacks.attach(trainer)`` finds it.

``auto_args`` returns plain ``TrainingArguments`` kwargs, which ``TrainingArguments(**kwargs)`` unpacks field by
field, so nothing of the plan can ride along into the arguments the Trainer holds. It is kept here instead, one per
process: the plan of the last ``auto_args`` call. ``attach(trainer)`` without ``plan=`` checks the live run against
it (:class:`hf_dist.callbacks.plan.PlanCallback`); ``attach(trainer, plan=p)`` checks against ``p``, and
``attach(trainer, plan=False)`` against none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hf_dist.planning.plan_result import Plan

_last: Plan | None = None  # the last auto_args call's plan


def remember(plan: Plan) -> None:
    """Keep ``plan`` as the plan of this process's run (``auto_args`` does, after validating its kwargs)."""
    global _last
    _last = plan


def last_plan() -> Plan | None:
    """The plan the last ``auto_args`` call of this process made (or was given), or None."""
    return _last


def forget() -> None:
    """Drop the remembered plan (tests; a process that plans one run and then trains another)."""
    global _last
    _last = None
