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
from hf_dist.planning.search import Search, search_space
from hf_dist.planning.throughput import comm_seconds

__all__ = ["Plan", "PlanError", "Candidate", "Combo", "plan", "comm_seconds", "micro_batch_options"]


def plan(
    model: Any, *, gpus: int | None = None, gpu_memory_gib: float | None = None, nodes: int | None = None,
    method: str | None = None, seq_len: int | None = None, global_batch_size: int | None = None,
    micro_batch_size: int | None = None, optimizer: str = "adamw", lora_rank: int | None = None,
    lora_dropout: float | None = None, lora_targets: Any = None, peft_config: Any = None, strategy: str | None = None,
    offload: str | None = None, activation_checkpointing: bool | None = None, use_liger_kernel: bool | None = None,
    safety_margin: float = 0.1, hardware: Hardware | None = None, pure_bf16: bool = False,
    tp_size: int | None = None, cp_size: int | None = None, sp_size: int | None = None,
    host_memory_gib: float | None = None, nvme_gbps: float | None = None, offload_device: str | None = None,
    features: Any = None, fused_lm_head: bool = False, async_save: bool = False,
    train_tokens: int | float | None = None, sync_each_batch: bool | None = None, trust_remote_code: bool = False,
) -> Plan:  # fmt: skip
    """Plan distributed training of ``model`` (count, config, module, folder, config.json or hub name).

    ``strategy`` / ``offload`` / ``activation_checkpointing`` / ``use_liger_kernel`` / ``sync_each_batch`` pin a
    choice instead of searching it (Liger kernels are searched on CUDA when liger-kernel is installed;
    ``sync_each_batch``: FSDP2 with gradient accumulation reduce-scatters every micro-batch instead of holding every
    unsharded gradient until the last, searched where gradients accumulate).

    LoRA (:mod:`hf_dist.planning.lora`): a ``PeftModel``'s own config is planned (rank, alpha, dropout, targets,
    ``modules_to_save``, bias, rsLoRA); ``peft_config`` (a PEFT ``LoraConfig``) does the same before the model
    exists; ``lora_rank`` / ``lora_dropout`` / ``lora_targets`` adjust the recipes' LoRA (rank 16, dropout 0.05,
    every linear of the block) and must agree with a given config. ``method`` (default: ``lora`` when any of them is
    given, else ``full``). A config hf_dist cannot plan (IA3, prefix tuning, DoRA, a target matching no module) is
    refused by name.
    ``pure_bf16=True`` plans bf16 weights and bf16 Adam state without fp32 master weights (less memory,
    less accurate updates); by default mixed precision keeps fp32 masters. A module's loaded dtype is
    read (``Plan.model_dtype``); dtypes other than float32/bfloat16/float16 raise ValueError.

    ``seq_len``: tokens per sequence (default 2048, or the model's ``max_position_embeddings`` when fewer); one
    beyond the positions of a config that scales no RoPE is refused before anything is searched
    (:func:`hf_dist.planning.config_checks.resolve_seq_len`, the recipes' check of ``--max_seq_length`` too).

    Model parallelism: ``tp_size`` / ``cp_size`` / ``sp_size`` pin a size (1 turns the dimension off); left
    None, the sizes the model, hardware and installed libraries allow (:mod:`hf_dist.planning.model_parallel`)
    are searched when no data-parallel layout fits without offload or the global batch is smaller than the
    GPUs; a global batch the GPUs do not divide is refused (with the nearest sizes they do) when a data-parallel
    layout fits at one they divide, rather than split the model for it. ``host_memory_gib`` (RAM per node) and ``nvme_gbps`` (the nodes' NVMe bandwidth; given, NVMe offload
    is searched when nothing else fits) describe the hardware when ``hardware`` is not passed. ``offload_device``
    pins where offloaded states go: ``"nvme"`` plans ZeRO-Infinity (ZeRO-3 only, with offload ``optimizer`` or
    ``optimizer+params``; ``Plan.swap_bytes`` is the space its swap files need per node), ``"cpu"`` never
    searches NVMe. ``features``: what
    the libraries accept (default: the installed ones, ``hf_dist.planning.features.installed_features()``).
    ``fused_lm_head=True``: the loss runs through TRL's fused LM head (``SFTTrainer``; ``auto_args(config_class=
    SFTConfig)`` sets it), which never holds the logits. ``async_save=True``: checkpoints are staged in host RAM and
    written in the background (``attach(trainer, async_save=True)``); the staging copy counts against each node's
    host RAM (``Plan.staging_bytes``). ``train_tokens``: the tokens the run will train on; the
    plan then states the estimated wall time and GPU-hours of its choice and of the alternatives
    (:meth:`Plan.time_to_finish`). Tracing the choice (``hf_dist.plan(..., verify=True)``) is
    :func:`hf_dist.tracing.checked_plan.plan`'s, a floor above. ``trust_remote_code=True`` lets a folder's ``auto_map``
    classes be imported; without it they never are (:mod:`hf_dist.planning.remote_code`).
    Raises PlanError (a ValueError) naming the minimum hardware when nothing fits.
    """
    sizes = (tp_size, cp_size, sp_size)
    lora_keywords = dict(lora_rank=lora_rank, lora_dropout=lora_dropout, lora_targets=lora_targets)
    method, lora = resolve(model, method, peft_config, **lora_keywords)
    _check_arguments(method, safety_margin, train_tokens, seq_len, global_batch_size, micro_batch_size, *sizes)
    hw = hardware or detect_hardware(gpus=gpus, gpu_memory_gib=gpu_memory_gib, nodes=nodes,
                                     host_memory_gib=host_memory_gib, nvme_gbps=nvme_gbps)  # fmt: skip
    space = search_space(hw, method, strategy, offload, offload_device, activation_checkpointing, use_liger_kernel,
                         sync_each_batch)  # fmt: skip
    check_pure_bf16_hardware(pure_bf16, hw)
    model_dtype, spec = loaded_dtype(model), model_spec(model, trust_remote_code=trust_remote_code)
    seq_len = resolve_seq_len(seq_len, spec if spec.config is None else spec.config)
    features = installed_features() if features is None else features
    placement = place(spec, lora) if lora is not None else None
    setup = _setup(spec, hw, model_dtype, features, pure_bf16, safety_margin, method, optimizer, seq_len, placement,
                   global_batch_size, micro_batch_size, fused_lm_head, async_save)  # fmt: skip
    options = size_options(spec, hw, seq_len, features, method=method)
    pinned = pinned_sizes(spec, options, *(v or 1 for v in sizes)) if any(v is not None for v in sizes) else None
    search = Search(setup, *space, strategy is not None, features, offload_device)
    candidates, dims = search.run(options, pinned)
    chosen = _choose(
        setup, search, candidates, dims, pinned is not None, offload not in (None, "none") or bool(offload_device)
    )
    liger_note = liger_gain(setup, chosen) if use_liger_kernel is None and _liger_missing(hw, spec) else ""
    notes = (liger_note, near_miss(setup, candidates, chosen, safety_margin), lora_without_offload(setup, chosen))
    return _result(
        setup, chosen, candidates, dims, hardware_precision(hw)[0], notes, pure_bf16, model_dtype, train_tokens
    )


def _setup(spec, hw, model_dtype, features, pure_bf16, safety_margin, method, optimizer, seq_len, lora,
           global_batch, micro_batch, fused_lm_head, async_save) -> Setup:  # fmt: skip
    """The run every candidate shares: its precision on ``hw`` (fp32 masters unless pure bf16) and usable memory."""
    _, pb, master = hardware_precision(hw)
    return Setup(
        spec, hw, method, optimizer, seq_len, lora, pb, master and not pure_bf16,
        4 if model_dtype == "float32" else pb, usable=(1 - safety_margin) * hw.gpu_memory_gib * GIB,
        trainable=trainable_params(spec, method, lora), global_batch=global_batch, micro_batch=micro_batch,
        checkpoint_children=features.fsdp2_checkpoints_children, embedding_unit=features.fsdp2_embedding_unit,
        fused_lm_head=bool(fused_lm_head), async_save=bool(async_save),
    )  # fmt: skip


def _check_arguments(method, safety_margin, train_tokens, seq_len, global_batch, micro_batch, *sizes) -> None:
    """Refuse a bad method, margin, token count, sequence length, batch size or model-parallel size (``sizes``: tp,
    cp, sp)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
    if train_tokens is not None and (
        isinstance(train_tokens, bool) or not isinstance(train_tokens, int | float) or not train_tokens >= 1
    ):
        raise ValueError(f"train_tokens must be a positive number of tokens (e.g. 2e9), got {train_tokens!r}")
    for name, value in (("seq_len", seq_len), ("global_batch_size", global_batch), ("micro_batch_size", micro_batch)):
        if not _positive_int_or_none(value):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in zip(("tp_size", "cp_size", "sp_size"), sizes, strict=True):
        if not _positive_int_or_none(value):
            raise ValueError(f"{name} must be a positive int (1 = off) or None (search), got {value!r}")


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
        strategy=c.strategy, offload=c.offload, activation_checkpointing=c.activation_checkpointing,
        micro_batch_size=c.micro_batch_size, gradient_accumulation_steps=global_batch // (c.micro_batch_size * dp),
        global_batch_size=global_batch, num_params=s.spec.num_params, memory=c.memory, candidates=candidates,
        world_size=hw.world_size, nodes=hw.nodes, method=s.method, seq_len=s.seq_len, mixed_precision=mp, hardware=hw,
        model=s.spec, optimizer=s.optimizer, lora=s.lora.lora if s.lora else None, reason=c.reason,
        usable_gib=s.usable / GIB, trainable_params=s.trainable, sync_each_batch=c.sync_each_batch,
        use_liger_kernel=c.use_liger_kernel, tokens_per_s=c.tokens_per_s, liger_note=liger_note,
        margin_note=margin_note, offload_note=offload_note, pure_bf16=pure_bf16, model_dtype=model_dtype,
        tp_size=c.tp_size, cp_size=c.cp_size, sp_size=c.sp_size, offload_device=c.offload_device,
        dimensions=dims + chosen_dimensions(c), load=load_for(s, c.key),
        staging_bytes=staging_per_node(s, c.key, c.memory) if s.async_save else None,
        fused_lm_head=s.fused_lm_head, train_tokens=None if train_tokens is None else int(train_tokens),
    )  # fmt: skip
