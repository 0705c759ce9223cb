"""What an ``auto_args`` call asked for, sorted before anything is planned: planner keywords, ``auto_args``' own
keywords, and ``TrainingArguments`` (or ``config_class``) fields.

A keyword that is none of them is refused here (a typo must not be dropped silently). Two keywords that say the same
thing differently (``micro_batch_size`` and ``per_device_train_batch_size``; TRL's ``max_length`` and ``seq_len``;
``plan=`` and planner keywords) are not refused here: the plan is made from one of them and the disagreement is kept
in :attr:`Request.conflicts`, which :mod:`hf_dist.configs.validate` reports with every other contradiction at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_dist.configs.config_class import class_fields, plan_from_class
from hf_dist.planning.request import PlanRequest

__all__ = ["PLAN_KEYS", "CONFIG_KEYS", "Request", "read_request"]

# Keywords that go to hf_dist.plan() rather than TrainingArguments: PlanRequest's fields, except the installed
# libraries' features (auto_args plans for the installed ones) and trust_remote_code (auto_args' own: it also governs
# the FSDP wrap classes it finds in the model).
PLAN_KEYS = tuple(f.name for f in dataclasses.fields(PlanRequest) if f.name not in ("features", "trust_remote_code"))
# Keywords auto_args itself consumes.
CONFIG_KEYS = (
    "plan",
    "wrap_classes",
    "lr_scaling",
    "reference_batch_size",
    "cpu_adam",
    "trust_remote_code",
    "nvme_path",
    "config_class",
    "engine_on_cpu",
)


@dataclasses.dataclass
class Request:
    """One ``auto_args`` call's keywords, sorted.

    ``plan_kwargs``: for the planner (``config_class``'s memory fields folded in); ``own``: auto_args' keywords;
    ``user``: ``TrainingArguments`` fields, which win over the generated ones unless they contradict the plan;
    ``from_class``: the ``config_class`` fields the plan fixes (TRL's ``max_length``); ``conflicts``: disagreements
    found while sorting, reported by the validation step with the others."""

    plan_kwargs: dict[str, Any]
    own: dict[str, Any]
    user: dict[str, Any]
    from_class: dict[str, Any] = dataclasses.field(default_factory=dict)
    conflicts: list[str] = dataclasses.field(default_factory=list)

    @property
    def given_plan(self) -> Any:
        return self.own.get("plan")

    @property
    def cpu_adam(self) -> bool:
        return self.own.get("cpu_adam", True)


def read_request(overrides: dict[str, Any], planned: PlanRequest | None = None) -> Request:
    """Sort ``auto_args``' keywords (and the fields ``planned`` sets) into a :class:`Request`; an unknown keyword, or
    a field given both ways with different values, is refused."""
    from transformers import TrainingArguments

    overrides = {**_fields_set(planned, overrides), **overrides}

    plan_kwargs = {k: v for k, v in overrides.items() if k in PLAN_KEYS and v is not None}
    own = {k: v for k, v in overrides.items() if k in CONFIG_KEYS}
    user = {k: v for k, v in overrides.items() if k not in PLAN_KEYS and k not in CONFIG_KEYS}
    config_class = own.get("config_class") or TrainingArguments
    unknown = sorted(k for k in user if k not in class_fields(config_class))
    if unknown:
        raise ValueError(
            f"auto_args got unknown keyword(s) {unknown}: not fields of {config_class.__name__} (config_class=) of the "
            f"installed versions, nor planner keywords {list(PLAN_KEYS)}, nor auto_args keywords {list(CONFIG_KEYS)}."
        )
    request = Request(plan_kwargs, own, user)
    _micro_batch(request)
    if request.given_plan is not None and plan_kwargs:
        request.conflicts.append(
            f"pass either plan= or planner keywords, not both (got plan= and {sorted(plan_kwargs)})."
        )
    request.from_class, class_conflicts = plan_from_class(
        own.get("config_class"), plan_kwargs, user, request.given_plan
    )  # e.g. TRL's max_length is the plan's seq_len
    request.conflicts += class_conflicts
    return request


def _fields_set(planned: PlanRequest | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The fields ``planned`` sets to other than their defaults; one the keywords give a different value is refused."""
    if planned is None:
        return {}
    if not isinstance(planned, PlanRequest):
        raise TypeError(f"auto_args' request must be a hf_dist.PlanRequest, got {type(planned).__name__}")
    given = planned.given()
    twice = sorted(k for k in given if k in overrides and overrides[k] != given[k])
    if twice:
        both = ", ".join(f"{k}: {given[k]!r} in the request, {overrides[k]!r} as a keyword" for k in twice)
        raise ValueError(f"auto_args got two values for the same field ({both}); give each once")
    return given


def _micro_batch(request: Request) -> None:
    """``per_device_train_batch_size`` is the planner's ``micro_batch_size``: the plan is made for the user's."""
    user, plan_kwargs = request.user, request.plan_kwargs
    if "per_device_train_batch_size" not in user:
        return
    mbs = user["per_device_train_batch_size"]
    if plan_kwargs.get("micro_batch_size", mbs) != mbs:
        request.conflicts.append(
            f"micro_batch_size ({plan_kwargs['micro_batch_size']}) != per_device_train_batch_size ({mbs}); "
            "they are the same thing, pass one."
        )
    plan_kwargs["micro_batch_size"] = mbs
