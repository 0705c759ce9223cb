"""Choose the distributed strategy: the fastest one that fits, with a reason for every alternative.

Rules, in order (each candidate's ``reason`` says which one decided):
1. A candidate fits when its predicted device memory (hf_dist.planning.memory: tensors, caching allocator,
   CUDA context) <= (1 - safety_margin) * GPU memory.
2. Avoid CPU offload unless nothing fits without it (it also needs host RAM and a CPU optimizer).
3. Among the rest, the highest estimated tokens/s (hf_dist.planning.throughput: compute with recompute when
   checkpointing, activation traffic, per-op dispatch per micro-step, optimizer, communication).
   Activation checkpointing and Liger kernels are chosen by that estimate, not by rule.
4. Ties go to the simpler strategy (``Strategy.preference`` in the registry). At the same sharding level FSDP2 comes before
   DeepSpeed: FSDP2 is native to the Trainer on transformers 5 (no extra dependency, DCP
   checkpoints). DeepSpeed ZeRO wins when it is cheaper (ZeRO-1/2 all-gather once per optimizer step)
   or when only the optimizer must be offloaded (FSDP2 offloads parameters and optimizer together).
5. A layout with more sharding or parallelism beats a simpler one only by more than the throughput model's measured
   error (``choice.LAYOUT_ERROR``, 15 %).
Each (strategy, offload, checkpointing, Liger, tp/cp/sp sizes) uses the micro-batch that fits with the highest
estimated tokens/s; gradient accumulation keeps the global batch: global = micro * accumulation * dp, dp being
the data-parallel size (world / (tp * cp * sp)). Tensor / context / sequence parallelism and NVMe offload are
searched only when data parallelism is not enough (:class:`hf_dist.planning.search.Search`, docs/parallelism.md).
"""

from __future__ import annotations

from typing import Any

from hf_dist.planning.advice import (
    chosen_dimensions,
    liger_gain,
    lora_without_offload,
    near_miss,
    nothing_fits_message,
)
from hf_dist.planning.candidates import Setup, load_for, micro_batch_options, staging_per_node
from hf_dist.planning.choice import best, reason_for
from hf_dist.planning.config_checks import resolve_seq_len
from hf_dist.planning.dtypes import GIB
from hf_dist.planning.features import installed_features
from hf_dist.planning.hardware import Hardware, detect_hardware
from hf_dist.planning.lora_plan import place, resolve
from hf_dist.planning.memory import METHODS
from hf_dist.planning.model_parallel import pinned_sizes, size_options
from hf_dist.planning.model_states import trainable_params
from hf_dist.planning.modelinfo import model_spec
from hf_dist.planning.plan_result import Candidate, Combo, Plan, PlanError
from hf_dist.planning.precision import check_pure_bf16_hardware, hardware_precision, loaded_dtype
from hf_dist.planning.request import PlanRequest
from hf_dist.planning.search import Search, search_space
from hf_dist.planning.throughput import comm_seconds

__all__ = ["Plan", "PlanError", "PlanRequest", "Candidate", "Combo", "plan", "comm_seconds", "micro_batch_options"]


def plan(model: Any, request: PlanRequest | None = None, **keywords: Any) -> Plan:
    """Plan distributed training of ``model`` (count, config, module, folder, config.json or hub name) for
    ``request`` (a :class:`~hf_dist.planning.request.PlanRequest`; ``keywords``: its fields, set over it).

    Each field's meaning is its help text in :class:`~hf_dist.planning.request.PlanRequest`. In short: the hardware
    is detected unless described; ``strategy`` / ``offload`` / ``activation_checkpointing`` / ``use_liger_kernel`` /
    ``sync_each_batch`` and the ``tp``/``cp``/``sp`` sizes pin a choice instead of searching it; model parallelism is
    searched when no data-parallel layout fits without offload or the global batch is smaller than the GPUs, and a
    global batch the GPUs do not divide is refused (with the nearest sizes they do) when a data-parallel layout fits
    at one they divide, rather than split the model for it.

    LoRA (:mod:`hf_dist.planning.lora`): a ``PeftModel``'s own config is planned; ``peft_config`` does the same
    before the model exists; ``lora_rank`` / ``lora_dropout`` / ``lora_targets`` adjust the recipes' LoRA and must
    agree with a given config. A config hf_dist cannot plan (IA3, prefix tuning, DoRA, a target matching no module)
    is refused by name. A module's loaded dtype is read (``Plan.model_dtype``); dtypes other than
    float32/bfloat16/float16 raise ValueError. ``seq_len`` beyond the positions of a config that scales no RoPE is
    refused before anything is searched (:func:`hf_dist.planning.config_checks.resolve_seq_len`, the recipes'
    check of ``--max_seq_length`` too). Tracing the choice (``verify``) is :func:`hf_dist.tracing.checked_plan.plan`'s
    (``hf_dist.plan``), a floor above; this search refuses ``verify=True``.
    Raises PlanError (a ValueError) naming the minimum hardware when nothing fits.
    """
    r = PlanRequest.of(request, keywords)
    lora_keywords = dict(lora_rank=r.lora_rank, lora_dropout=r.lora_dropout, lora_targets=r.lora_targets)
    method, lora = resolve(model, r.method, r.peft_config, **lora_keywords)
    _check_arguments(method, r)
    hw = r.hardware or detect_hardware(**r.hardware_keywords())
    space = search_space(hw, method, r.strategy, r.offload, r.offload_device, r.activation_checkpointing,
                         r.use_liger_kernel, r.sync_each_batch)  # fmt: skip
    check_pure_bf16_hardware(r.pure_bf16, hw)
    model_dtype, spec = loaded_dtype(model), model_spec(model, trust_remote_code=r.trust_remote_code)
    seq_len = resolve_seq_len(r.seq_len, spec if spec.config is None else spec.config)
    features = installed_features() if r.features is None else r.features
    placement = place(spec, lora) if lora is not None else None
    setup = _setup(spec, hw, model_dtype, features, method, seq_len, placement, r)
    sizes = (r.tp_size, r.cp_size, r.sp_size)
    options = size_options(spec, hw, seq_len, features, method=method)
    pinned = pinned_sizes(spec, options, *(v or 1 for v in sizes)) if any(v is not None for v in sizes) else None
    search = Search(setup, *space, r.strategy is not None, features, r.offload_device)
    candidates, dims = search.run(options, pinned)
    offload_pinned = r.offload not in (None, "none") or bool(r.offload_device)
    chosen = _choose(setup, search, candidates, dims, pinned is not None, offload_pinned)
    liger_note = liger_gain(setup, chosen) if r.use_liger_kernel is None and _liger_missing(hw, spec) else ""
    notes = (liger_note, near_miss(setup, candidates, chosen, r.safety_margin), lora_without_offload(setup, chosen))
    return _result(
        setup, chosen, candidates, dims, hardware_precision(hw)[0], notes, r.pure_bf16, model_dtype, r.train_tokens
    )


def _setup(spec, hw, model_dtype, features, method, seq_len, lora, r: PlanRequest) -> Setup:
    """The run every candidate shares: its precision on ``hw`` (fp32 masters unless pure bf16) and usable memory."""
    _, pb, master = hardware_precision(hw)
    return Setup(
        spec, hw, method, r.optimizer, seq_len, lora, pb, master and not r.pure_bf16,
        4 if model_dtype == "float32" else pb, usable=(1 - r.safety_margin) * hw.gpu_memory_gib * GIB,
        trainable=trainable_params(spec, method, lora), global_batch=r.global_batch_size,
        micro_batch=r.micro_batch_size, checkpoint_children=features.fsdp2_checkpoints_children,
        embedding_unit=features.fsdp2_embedding_unit, fused_lm_head=bool(r.fused_lm_head),
        async_save=bool(r.async_save),
    )  # fmt: skip


def _check_arguments(method: str, r: PlanRequest) -> None:
    """Refuse a bad method, margin, token count, sequence length, batch size or model-parallel size, and a trace
    asked of the search."""
    if r.verify:
        raise ValueError(
            "the planner's search traces nothing: call hf_dist.plan(..., verify=True) to trace the choice"
        )
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if not 0 <= r.safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {r.safety_margin!r}")
    tokens = r.train_tokens
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int | float) or not tokens >= 1):
        raise ValueError(f"train_tokens must be a positive number of tokens (e.g. 2e9), got {tokens!r}")
    for name in ("seq_len", "global_batch_size", "micro_batch_size"):
        if not _positive_int_or_none(getattr(r, name)):
            raise ValueError(f"{name} must be a positive int, got {getattr(r, name)!r}")
    for name in ("tp_size", "cp_size", "sp_size"):
        if not _positive_int_or_none(getattr(r, name)):
            raise ValueError(f"{name} must be a positive int (1 = off) or None (search), got {getattr(r, name)!r}")


def _positive_int_or_none(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def _liger_missing(hw: Hardware, spec) -> bool:
    return hw.device == "cuda" and not hw.liger_kernel and spec.has_shape


def _choose(setup: Setup, search: Search, candidates, dims, sizes_pinned: bool, offload_pinned: bool) -> Candidate:
    """The best fitting candidate, every candidate's reason set; PlanError saying why when none fits."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise PlanError(nothing_fits_message(setup, search.dp_combos, candidates, dims))
    chosen = best(fitting)
    for c in candidates:
        c.reason = reason_for(c, chosen, pinned=sizes_pinned, offload_pinned=offload_pinned, candidates=candidates,
                              split_reason=search.split_reason)  # fmt: skip
    return chosen


def _result(s: Setup, c: Candidate, candidates, dims, mp, notes, pure_bf16, model_dtype, train_tokens) -> Plan:
    """The :class:`Plan` of the chosen candidate ``c``; ``notes``: the Liger, margin and offload notes."""
    hw, dp = s.hw, c.key.layout(s.hw).dp_size
    global_batch = s.global_batch or c.micro_batch_size * dp
    liger_note, margin_note, offload_note = notes
    return Plan(
        layout=c.key.layout(hw, mixed_precision=mp, pure_bf16=pure_bf16),
        micro_batch_size=c.micro_batch_size, gradient_accumulation_steps=global_batch // (c.micro_batch_size * dp),
        global_batch_size=global_batch, num_params=s.spec.num_params, memory=c.memory, candidates=candidates,
        method=s.method, seq_len=s.seq_len, hardware=hw,
        model=s.spec, optimizer=s.optimizer, lora=s.lora.lora if s.lora else None, reason=c.reason,
        usable_gib=s.usable / GIB, trainable_params=s.trainable,
        use_liger_kernel=c.use_liger_kernel, tokens_per_s=c.tokens_per_s, liger_note=liger_note,
        margin_note=margin_note, offload_note=offload_note, model_dtype=model_dtype,
        dimensions=dims + chosen_dimensions(c), load=load_for(s, c.key),
        staging_bytes=staging_per_node(s, c.key, c.memory) if s.async_save else None,
        fused_lm_head=s.fused_lm_head, train_tokens=None if train_tokens is None else int(train_tokens),
    )  # fmt: skip
