"""``auto_args(..., config_class=...)``: kwargs for a ``TrainingArguments`` subclass, such as TRL's ``SFTConfig``.

A subclass has its own defaults (TRL's ``SFTConfig``: ``gradient_checkpointing=True``, ``bf16`` on by device,
``max_length=1024``), so ``auto_args`` emits every key its plan depends on explicitly (precision, checkpointing,
batch split, engine configs), accepts the subclass's own fields as keywords, and plans the fields that change
memory:

- ``max_length`` (TRL) is the sequence length the plan is for: taken as ``seq_len`` when none is given (the class
  default when neither is), refused when both are given and differ, and emitted so the class's default cannot
  differ from the plan;
- ``packing`` / ``padding_free`` put at most ``micro_batch x max_length`` tokens in a micro-batch, the tokens the plan
  counts; accepted as given, except ``padding_free`` without ``packing``, which TRL does not truncate: refused;
- ``activation_offloading`` moves saved activations to host memory, which the plan does not model: refused, with
  the planner keywords that lower activation memory instead;
- TRL's ``SFTTrainer`` computes the loss (``loss_type`` ``nll`` or ``dft``) through its fused LM head, which never
  holds the logits: the plan counts that head (``plan(fused_lm_head=True)``), or the full logits when
  ``label_smoothing_factor`` > 0 asks for them; a plan or keyword that says otherwise is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SEQ_FIELD = "max_length"  # TRL's SFTConfig: the length sequences are truncated or packed to


def class_fields(config_class: Any) -> dict[str, Any]:
    """``{field: default}`` of a ``TrainingArguments`` subclass (``config_class``), refused when it is not one."""
    from transformers import TrainingArguments

    if not (isinstance(config_class, type) and issubclass(config_class, TrainingArguments)):
        raise ValueError(
            f"config_class must be TrainingArguments or a subclass of it (e.g. trl.SFTConfig), got {config_class!r}"
        )
    return {f.name: f.default for f in dataclasses.fields(config_class) if f.init}


def plan_from_class(
    config_class: Any, plan_kwargs: dict[str, Any], user: dict[str, Any], plan: Any = None
) -> tuple[dict[str, Any], list[str]]:
    """Fold ``config_class``'s memory fields into ``plan_kwargs`` (mutated); return the kwargs to emit for them and
    the contradictions found (``auto_args`` reports them with every other one)."""
    if config_class is None:
        return {}, []
    defaults = class_fields(config_class)
    conflicts = _loss_head_conflicts(config_class, defaults, plan_kwargs, user, plan)
    if user.get("activation_offloading"):
        conflicts.append(
            "activation_offloading=True moves saved activations to host memory, which the plan does not model (its "
            "memory estimate would be wrong both ways). Drop it; to lower activation memory let the plan choose, or "
            "pass activation_checkpointing=True / a smaller micro_batch_size to auto_args."
        )
    if SEQ_FIELD not in defaults:
        return {}, conflicts
    if user.get("padding_free") and not user.get("packing", defaults.get("packing")):
        conflicts.append(
            f"padding_free=True without packing: {config_class.__name__}'s trainer then does not truncate to "
            f"{SEQ_FIELD}, so a micro-batch's tokens have no bound the plan could count.\n"
            "  Pass packing=True as well (each packed sequence holds at most max_length tokens), or drop padding_free"
        )
    planned, seq_conflict = _sequence_length(config_class, defaults, plan_kwargs, user, plan)
    user.pop(SEQ_FIELD, None)
    return ({SEQ_FIELD: planned} if planned is not None else {}), conflicts + seq_conflict


def _sequence_length(config_class: Any, defaults: dict, plan_kwargs: dict, user: dict, plan: Any) -> tuple:
    """The sequence length the plan is for (TRL's ``max_length`` when no ``seq_len`` is given), and a conflict when
    the two disagree or neither bounds the sequences."""
    planned = plan.seq_len if plan is not None else plan_kwargs.get("seq_len")
    given = user.get(SEQ_FIELD, defaults[SEQ_FIELD])
    if planned is None and given is None:
        return None, [
            f"{config_class.__name__}({SEQ_FIELD}=None) leaves sequences untruncated: the plan needs their length; "
            f"pass {SEQ_FIELD}= (or seq_len=) to auto_args"
        ]
    if planned is None:
        plan_kwargs["seq_len"] = int(given)
        return int(given), []
    if SEQ_FIELD in user and user[SEQ_FIELD] != planned:
        return planned, [
            f"{SEQ_FIELD}={user[SEQ_FIELD]} contradicts the plan's seq_len {planned}: they are the same length (the "
            f"length {config_class.__name__} truncates or packs to); pass one."
        ]
    return planned, []


def _loss_head_conflicts(config_class: Any, defaults: dict, plan_kwargs: dict, user: dict, plan: Any) -> list[str]:
    """Plan TRL's fused LM head when ``config_class`` is TRL's ``SFTConfig`` (``SFTTrainer`` computes its loss
    there unless label smoothing needs the full logits); a plan or keyword that says otherwise is a conflict."""
    if config_class.__module__.split(".")[0] != "trl":
        return []
    from trl import SFTConfig

    if not issubclass(config_class, SFTConfig):
        return []
    fused = not user.get("label_smoothing_factor", defaults.get("label_smoothing_factor", 0.0))
    why = "its fused LM head, without the logits" if fused else "the full logits (label_smoothing_factor > 0)"
    planned = plan.fused_lm_head if plan is not None else plan_kwargs.get("fused_lm_head", fused)
    if plan is None:
        plan_kwargs["fused_lm_head"] = fused
    if bool(planned) == fused:
        return []
    return [
        f"{config_class.__name__}'s trainer computes the loss through {why}, but the plan has "
        f"fused_lm_head={bool(planned)}: drop fused_lm_head (auto_args sets it from the config class), or plan "
        f"with fused_lm_head={fused}."
    ]
