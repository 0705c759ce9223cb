"""``plan(..., verify=True)``: the chosen layout traced, and replaced by the next one when the trace does not fit.

:func:`plan` is ``hf_dist.plan``: the planner's search (:func:`hf_dist.planning.planner.plan`), then, with
``verify=True``, :func:`verify_plan`.

The analytic plan stands where a layout cannot be traced (Liger, offload, CP, AutoTP; the plan says why). A
traced layout fits when its traced peak plus the memory model's non-tensor terms (caching allocator, CUDA context)
stays within the usable memory; otherwise the candidate is marked as not fitting, with the traced figure as its
reason, and the next best candidate is traced in turn (at most :data:`MAX_TRACED` of them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_dist.planning.choice import best, reason_for
from hf_dist.planning.dtypes import GIB
from hf_dist.planning.plan_result import Plan, PlanError, format_bytes
from hf_dist.planning.planner import plan as search_plan
from hf_dist.tracing.setup import TraceUnsupported
from hf_dist.tracing.trace import TraceError, TraceTimeout

MAX_TRACED = 3


def plan(
    model: Any,
    *,
    verify: bool = False,
    verify_time_limit_s: float = 120.0,
    trust_remote_code: bool = False,
    **planner_keywords: Any,
) -> Plan:
    """:func:`hf_dist.planning.planner.plan` (``planner_keywords``: its keywords), then, with ``verify=True``, the
    chosen layout traced on the real model with fake tensors (:mod:`hf_dist.tracing`, seconds to a minute; at most
    ``verify_time_limit_s`` per trace), moving to the next candidate when the trace does not fit (``Plan.trace``,
    ``Plan.verification``; docs/planner.md, "Tracing"). ``trust_remote_code=True`` lets a folder's ``auto_map``
    classes be imported, by the planner and the trace alike; without it they never are
    (:mod:`hf_dist.planning.remote_code`)."""
    result = search_plan(model, trust_remote_code=trust_remote_code, **planner_keywords)
    if not verify:
        return result
    return verify_plan(result, time_limit_s=verify_time_limit_s, trust_remote_code=trust_remote_code)


def verify_plan(plan: Plan, *, time_limit_s: float, trust_remote_code: bool = False) -> Plan:
    """``plan`` with its choice traced: the same plan with ``trace`` set, or the next traced candidate that fits."""
    from hf_dist.tracing.api import trace_memory

    config = plan.model.config
    if config is None:
        return dataclasses.replace(plan, verification="not traced: a bare parameter count has no architecture to "
                                   "build; pass a config, folder or model (the analytic estimate stands)")  # fmt: skip
    usable = plan.usable_gib * GIB
    rejected: list[str] = []
    chosen = _chosen(plan)
    for _ in range(MAX_TRACED):
        try:
            trace = trace_memory(config, plan, candidate=chosen, time_limit_s=time_limit_s,
                                 trust_remote_code=trust_remote_code)  # fmt: skip
        except (TraceUnsupported, TraceTimeout, TraceError) as exc:
            return _with_choice(plan, chosen, reason_for(chosen, chosen), note=f"not traced: {exc}", rejected=rejected)
        need = trace.device_total(chosen.memory)
        if need <= usable:
            return _with_choice(plan, chosen, reason_for(chosen, chosen), trace=trace, rejected=rejected)
        chosen.fits = False
        chosen.reason = (
            f"traced: {format_bytes(trace.peak_bytes)} of tensors + {format_bytes(need - trace.peak_bytes)} allocator "
            f"and context = {format_bytes(need)}, over the usable {format_bytes(usable)} (modelled "
            f"{format_bytes(chosen.memory.total)})"
        )
        rejected.append(f"{chosen.label}: {chosen.reason}")
        fitting = [c for c in plan.candidates if c.fits]
        if not fitting:
            raise PlanError(f"nothing fits once traced: {'; '.join(rejected)}")
        chosen = best(fitting)
    return _with_choice(plan, chosen, reason_for(chosen, chosen),
                        note=f"not traced: {MAX_TRACED} traced candidates did not fit", rejected=rejected)  # fmt: skip


def _chosen(plan: Plan) -> Any:
    return next(c for c in plan.candidates if c.key == plan._chosen_key)


def _with_choice(plan: Plan, c: Any, reason: str, *, trace: Any = None, note: str = "", rejected=()) -> Plan:
    """``plan`` re-pointed at candidate ``c`` (the batch split recomputed for its micro-batch and sizes)."""
    c.reason = reason
    dp = _layout(plan, c).dp_size
    moved = [f"traced and rejected {r}" for r in rejected]
    if trace is not None:
        note = (f"traced {c.label} ({trace.checked()}): {format_bytes(trace.peak_bytes)} allocated (modelled "
                f"{format_bytes(c.memory.allocated)})")  # fmt: skip
    return dataclasses.replace(
        plan, strategy=c.strategy, offload=c.offload, activation_checkpointing=c.activation_checkpointing,
        micro_batch_size=c.micro_batch_size, gradient_accumulation_steps=plan.global_batch_size // (c.micro_batch_size * dp),
        memory=c.memory, reason=reason, use_liger_kernel=c.use_liger_kernel, tokens_per_s=c.tokens_per_s,
        tp_size=c.tp_size, cp_size=c.cp_size, sp_size=c.sp_size, offload_device=c.offload_device,
        trace=trace, verification="; ".join([*moved, note]),
    )  # fmt: skip


def _layout(plan: Plan, c: Any) -> Any:
    return c.key.layout(plan.hardware)
