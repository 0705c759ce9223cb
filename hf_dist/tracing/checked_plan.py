"""``plan(..., verify=True)``: the chosen layout traced, and replaced by the next one when the trace does not fit.

:func:`plan` is ``hf_dist.plan``: the planner's search (:func:`hf_dist.planning.planner.plan`), then, with
``verify=True``, :func:`verify_plan`.

The analytic plan stands where a layout cannot be traced (offload, CP, DeepSpeed AutoTP or fp16; the plan says why in
one line). A traced layout fits when its traced device total (its allocations replayed through the caching allocator,
plus the CUDA context: :meth:`~hf_dist.tracing.result.TraceResult.device_total`) stays within the usable memory;
otherwise the candidate is marked as not fitting, with the traced figure as its
reason, and the next best candidate is traced in turn (at most :data:`MAX_TRACED` of them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hf_dist.planning.choice import best, reason_for
from hf_dist.planning.dtypes import GIB
from hf_dist.planning.plan_result import Plan, PlanError, format_bytes
from hf_dist.planning.planner import plan as search_plan
from hf_dist.planning.request import PlanRequest
from hf_dist.tracing.result import TraceError, TraceTimeout
from hf_dist.tracing.setup import TraceUnsupported
from hf_dist.tracing.speed import check_time_limit, scaled_limit

MAX_TRACED = 3


def plan(model: Any, request: PlanRequest | None = None, *, verify_isolate: bool = True, **keywords: Any) -> Plan:
    """:func:`hf_dist.planning.planner.plan` of ``request`` (``keywords``: its fields, set over it), then, with
    ``verify=True``, the chosen layout traced on the real model with fake tensors (:mod:`hf_dist.tracing`, seconds to
    a minute; at most ``verify_time_limit_s`` per trace, by default 120 s stretched by this machine's speed now:
    :func:`hf_dist.tracing.speed.scaled_limit`), moving to the next candidate when the trace does not fit
    (``Plan.trace``, ``Plan.verification``; docs/planner.md, "Tracing"); ``verify_isolate=False`` traces in this
    process instead of a worker (only where no process group exists and nothing else runs: ``hf-dist plan``, which
    saves the worker's imports). ``trust_remote_code=True`` lets a folder's ``auto_map`` classes be imported, by the
    planner and the trace alike; without it they never are (:mod:`hf_dist.planning.remote_code`)."""
    r = PlanRequest.of(request, keywords)
    given = r.verify_time_limit_s
    if r.verify and given is not None:  # refused before the search, not after it
        check_time_limit(given, "verify_time_limit_s (--verify-time-limit)")
    result = search_plan(model, dataclasses.replace(r, verify=False))
    if not r.verify:
        return result
    limit = given if given is not None else scaled_limit()
    return verify_plan(result, time_limit_s=limit, isolate=verify_isolate, trust_remote_code=r.trust_remote_code)


def verify_plan(plan: Plan, *, time_limit_s: float, isolate: bool = True, trust_remote_code: bool = False) -> Plan:
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
            trace = trace_memory(config, plan, candidate=chosen, time_limit_s=time_limit_s, isolate=isolate,
                                 trust_remote_code=trust_remote_code)  # fmt: skip
        except (TraceUnsupported, TraceTimeout, TraceError) as exc:
            note = f"not traced {chosen.label}: {why_not(exc)}; the analytic estimate stands"
            return _with_choice(
                plan, chosen, reason_for(chosen, chosen, candidates=plan.candidates), note=note, rejected=rejected
            )
        need = trace.device_total(chosen.memory)
        if need <= usable:
            return _with_choice(plan, chosen, reason_for(chosen, chosen, candidates=plan.candidates), trace=trace,
                                rejected=rejected, note=_traced_line(plan, chosen, trace, need))  # fmt: skip
        chosen.fits = False
        chosen.reason = (
            f"traced: {format_bytes(trace.peak_bytes)} of tensors + {format_bytes(need - trace.peak_bytes)} allocator "
            f"and context = {format_bytes(need)}, over the usable {format_bytes(usable)} (modelled "
            f"{format_bytes(chosen.memory.total)})"
        )
        rejected.append(f"{chosen.label} ({format_bytes(need)} traced with allocator and context)")
        fitting = [c for c in plan.candidates if c.fits]
        if not fitting:
            raise PlanError(f"nothing fits once traced: {'; '.join(rejected)}, over the usable {format_bytes(usable)}")
        chosen = best(fitting)
    return _with_choice(plan, chosen, reason_for(chosen, chosen, candidates=plan.candidates),
                        note=f"not traced: {MAX_TRACED} traced candidates did not fit", rejected=rejected)  # fmt: skip


def _traced_line(plan: Plan, c: Any, trace: Any, need: int) -> str:
    """What the trace checked, in one line: the layout, the rank (and the engine, DeepSpeed's, that ran on it:
    :meth:`~hf_dist.tracing.result.TraceResult.checked`), traced against modelled, and that it fits."""
    return (
        f"traced {c.label} on {trace.checked()} in {trace.seconds:.1f} s: {format_bytes(trace.peak_bytes)} "
        f"allocated (modelled {format_bytes(c.memory.allocated)}); {format_bytes(need)} with the allocator and CUDA "
        f"context fits the usable {format_bytes(plan.usable_gib * GIB)}"
    )


def why_not(exc: Exception, limit: int = 160) -> str:
    """Why a trace gave no figure, in one short clause: the refusal's reason, or the failure's first line cut to
    ``limit`` characters (the exception keeps the whole message)."""
    text = getattr(exc, "reason", None) or str(exc).splitlines()[0].removesuffix("; the analytic estimate stands")
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


def _chosen(plan: Plan) -> Any:
    return next(c for c in plan.candidates if c.key == plan._chosen_key)


def _with_choice(plan: Plan, c: Any, reason: str, *, trace: Any = None, note: str = "", rejected=()) -> Plan:
    """``plan`` re-pointed at candidate ``c`` (the batch split recomputed for its micro-batch and sizes)."""
    c.reason = reason
    layout = c.key.layout(plan.hardware, mixed_precision=plan.mixed_precision, pure_bf16=plan.pure_bf16)
    moved = [f"traced and rejected {r}" for r in rejected]
    return dataclasses.replace(
        plan, layout=layout, micro_batch_size=c.micro_batch_size, memory=c.memory, reason=reason,
        gradient_accumulation_steps=plan.global_batch_size // (c.micro_batch_size * layout.dp_size),
        use_liger_kernel=c.use_liger_kernel, tokens_per_s=c.tokens_per_s, trace=trace,
        verification="; ".join([*moved, note]),
    )  # fmt: skip
