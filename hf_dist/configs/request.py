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

__all__ = ["PLAN_KEYS", "CONFIG_KEYS", "Request", "read_request"]

# Keywords that go to hf_dist.plan() rather than TrainingArguments.
PLAN_KEYS = (
    "gpus",
    "gpu_memory_gib",
    "nodes",
    "method",
    "seq_len",
    "global_batch_size",
    "micro_batch_size",
    "optimizer",
    "lora_rank",
    "lora_dropout",
    "lora_targets",
    "peft_config",
    "strategy",
    "offload",
    "activation_checkpointing",
    "use_liger_kernel",
    "safety_margin",
    "hardware",
    "pure_bf16",
    "tp_size",
    "cp_size",
    "sp_size",
    "host_memory_gib",
    "nvme_gbps",
    "offload_device",
    "fused_lm_head",
    "async_save",
    "train_tokens",
    "sync_each_batch",
    "verify",
    "verify_time_limit_s",
)
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


def read_request(overrides: dict[str, Any]) -> Request:
    """Sort ``auto_args``' keywords into a :class:`Request`; an unknown keyword is refused."""
    from transformers import TrainingArguments

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
