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
searched only when data parallelism is not enough (:class:`_Search`, docs/parallelism.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hf_dist.configs.features import check_features
from hf_dist.planning.hardware import Hardware, detect_hardware
from hf_dist.planning.layout import OFFLOAD_DEVICES, OFFLOADS, REGISTRY, STRATEGIES
from hf_dist.planning.load_memory import LoadMemory, load_memory
from hf_dist.planning.memory import GIB, LORA_DROPOUT, METHODS, MemoryEstimate, engine_dtypes, estimate_memory
from hf_dist.planning.model_parallel import pinned_sizes, size_options
from hf_dist.planning.modelinfo import ModelSpec, model_spec
from hf_dist.planning.plan_result import Candidate, Combo, Plan, PlanError, format_bytes
from hf_dist.planning.throughput import StepTime, comm_seconds, model_parallel_seconds, nvme_seconds, step_time
from hf_dist.validation import restrict

__all__ = ["Plan", "PlanError", "Candidate", "Combo", "plan", "comm_seconds", "micro_batch_options"]

MAX_MICRO_BATCH = 16
# estimates closer than this are ties, which go to the simpler layout (the throughput model is not
# more precise than that)
TIE_FRACTION = 0.03


# ---------------------------------------------------------------- batch math


def micro_batch_options(global_batch, micro_batch, world) -> list[int]:
    """Micro-batch sizes to try, largest first, each dividing global / world."""
    if micro_batch is not None:
        if global_batch is not None and global_batch % (micro_batch * world):
            raise ValueError(
                f"global_batch ({global_batch}) is not divisible by micro_batch ({micro_batch}) * world ({world}) "
                f"= {micro_batch * world}; choose a global batch that is a multiple of {micro_batch * world}"
            )
        return [micro_batch]
    if global_batch is None:
        return [1]
    if global_batch % world:
        raise ValueError(
            f"global_batch ({global_batch}) is not divisible by world size ({world}): "
            f"micro_batch * accumulation * {world} can never equal {global_batch}; use a multiple of {world}"
        )
    per_rank = global_batch // world
    return [m for m in range(min(per_rank, MAX_MICRO_BATCH), 0, -1) if per_rank % m == 0]


# ---------------------------------------------------------------- search


@dataclass(frozen=True)
class _Setup:
    spec: ModelSpec
    hw: Hardware
    method: str
    optimizer: str
    seq_len: int
    lora_rank: int
    pb: int
    master: bool
    base_bytes: int  # a LoRA model's frozen base as loaded: 4 for fp32, else 2
    usable: float
    trainable: int
    global_batch: int | None = None
    micro_batch: int | None = None
    checkpoint_children: bool = False  # LibraryFeatures.fsdp2_checkpoints_children
    embedding_unit: bool = True  # LibraryFeatures.fsdp2_embedding_unit
    fused_lm_head: bool = False  # TRL's fused LM head computes the loss (planning/activations.trl_head_bytes)
    async_save: bool = False  # checkpoints staged in host RAM, then written in the background


def _estimate(s: _Setup, combo: Combo, mb, world=None, nodes=None, accum=1) -> MemoryEstimate:
    return estimate_memory(
        s.spec,
        combo.strategy,
        world or s.hw.world_size,
        nodes=nodes or s.hw.nodes,
        method=s.method,
        offload=combo.offload,
        optimizer=s.optimizer,
        master_weights=s.master,
        base_bytes=s.base_bytes,
        param_bytes=s.pb,
        seq_len=s.seq_len,
        micro_batch_size=mb,
        activation_checkpointing=combo.ckpt,
        lora_rank=s.lora_rank,
        gradient_accumulation_steps=accum,
        use_liger_kernel=combo.liger,
        device=s.hw.device,
        tp_size=combo.tp,
        cp_size=combo.cp,
        sp_size=combo.sp,
        offload_device="nvme" if combo.nvme else "cpu",
        checkpoint_children=s.checkpoint_children,
        fsdp2_embedding_unit=s.embedding_unit,
        fused_lm_head=s.fused_lm_head,
    )


def _time(s: _Setup, combo: Combo, mb: int, accum: int, memory: MemoryEstimate) -> StepTime:
    hw, layout = s.hw, combo.layout(s.hw)
    strategy = REGISTRY[combo.strategy]
    spec = layout.rank_spec(s.spec)  # what one rank of a TP group holds and computes
    trainable = s.trainable // combo.tp
    grad_bytes = 4 if s.pb == 4 else 2  # what the collectives move (DeepSpeed reduces in the compute dtype)
    # the data-parallel collectives run over the ranks that hold the same TP slice
    comm = comm_seconds(strategy, combo.offload, spec, trainable, hw.world_size // combo.tp, hw.nodes, accum, s.pb,
                        grad_bytes, hw)  # fmt: skip
    comm += model_parallel_seconds(layout, s.spec, s.seq_len, mb, hw, combo.ckpt) * accum
    if combo.nvme:
        comm += nvme_seconds(s.spec, s.trainable, combo.offload, accum, s.pb, hw)
    return step_time(
        spec, hw, memory, strategy=strategy, offload=combo.offload, trainable=trainable, micro_batch_size=mb,
        accumulation=accum, seq_len=s.seq_len, activation_checkpointing=combo.ckpt, use_liger_kernel=combo.liger,
        comm=comm, dp_size=layout.dp_size, seq_shards=layout.seq_shards, tp_size=combo.tp,
        lora_adapters=len(spec.lora_linears) if s.method != "full" else 0, lora_dropout=LORA_DROPOUT > 0,
    )  # fmt: skip


def _combos(
    strategies, offloads, ckpts, ligers, hw: Hardware, pinned: bool, features, sizes=((1, 1, 1),)
) -> list[Combo]:
    """Every allowed combination. On one GPU there is nothing to shard: a sharding engine is only
    searched with offload (it would add its overhead for nothing), unless the strategy is pinned.
    ``sizes``: the (tp, cp, sp) triples to combine with them; those a layout or the installed libraries
    (``features``) refuse are left out."""
    out = []
    for liger in ligers:
        for offload in offloads:
            for ckpt in ckpts:
                for name in strategies:
                    s = REGISTRY[name]
                    if hw.nodes < s.min_nodes or (
                        hw.world_size == 1 and not s.is_ddp and offload == "none" and not pinned
                    ):
                        continue
                    if offload not in s.offloads:
                        continue
                    for tp, cp, sp in sizes:
                        combo = Combo(name, offload, ckpt, liger, tp, cp, sp)
                        if _refusal(combo, hw, features) is None:
                            out.append(combo)
    return out


def _refusal(combo: Combo, hw: Hardware, features) -> str | None:
    """Why ``combo`` cannot run on ``hw`` with the libraries ``features`` describes; None when it can."""
    try:
        layout = combo.layout(hw)
        check_features(layout, features)
    except ValueError as e:
        return str(e)
    if layout.strategy.is_ddp and combo.tp > 1 and layout.dp_size > 1:
        return (
            f"tp_size {combo.tp} with ddp over {hw.world_size} ranks: accelerate composes TP only with sharded data "
            "parallelism; use fsdp_full_shard for FSDP2 x TP, or tp_size = world size"
        )
    return None


def _load(s: _Setup, combo: Combo) -> LoadMemory:
    """Host RAM while ``combo``'s engine loads the model: each rank holds the plan's weight dtype (a LoRA model's
    frozen base: as loaded) until the engine moves the weights to the device."""
    held = engine_dtypes(combo.strategy, s.pb, s.master).weights if s.method == "full" else s.base_bytes
    return load_memory(
        s.spec.num_params, combo.strategy, held_bytes=held, checkpoint_bytes=s.spec.checkpoint_bytes,
        ranks_per_node=s.hw.gpus_per_node, tp_size=combo.tp,
    )  # fmt: skip


def staging_per_node(s: _Setup, combo: Combo, mem: MemoryEstimate) -> int:
    """Host RAM per node that async_save's staging copy takes (:mod:`hf_dist.checkpoint.lifecycle.async_save`): the states the
    node's ranks write. FSDP2 (DCP): every rank its shards of the weights and optimizer, wherever they live (offloaded
    ones too, ``mem.cpu``). DDP: rank 0 alone writes the weights (a LoRA model: its adapters) and ``optimizer.pt``.
    A tensor-parallel rank stages its shards too. DeepSpeed saves synchronously: nothing is staged."""
    strategy = REGISTRY[combo.strategy]
    if not s.async_save or strategy.is_deepspeed:
        return 0
    if strategy.shards.params or combo.tp > 1:
        return (mem.params + mem.optimizer + mem.cpu) * s.hw.gpus_per_node
    weights = mem.params if s.method == "full" else s.trainable * (4 if s.master else s.pb)
    return weights + mem.optimizer


def _candidate(s: _Setup, combo: Combo) -> Candidate:
    layout = combo.layout(s.hw)
    extra = dict(tp_size=combo.tp, cp_size=combo.cp, sp_size=combo.sp, offload_device="nvme" if combo.nvme else "cpu")
    strategy, offload, ckpt, liger = combo.strategy, combo.offload, combo.ckpt, combo.liger
    try:
        mbs = micro_batch_options(s.global_batch, s.micro_batch, layout.dp_size)
    except ValueError as e:
        mem = _estimate(s, combo, s.micro_batch or 1)
        return Candidate(strategy, offload, ckpt, s.micro_batch or 1, mem, False, str(e), None, liger, **extra)
    largest = _estimate(s, combo, mbs[-1])
    staging = staging_per_node(s, combo, largest)
    host_need = largest.cpu * s.hw.gpus_per_node + staging
    host_usable = s.usable / (s.hw.gpu_memory_gib * GIB) * s.hw.host_memory_limit_gib * GIB
    load = _load(s, combo)
    if s.hw.device != "cpu" and load.per_node > host_usable:
        reason = (
            f"loading needs {load.text()}, more than the usable {format_bytes(host_usable)} of host RAM per node "
            "(ZeRO-3 reads the weights on rank 0 only; pass --host-memory / plan(host_memory_gib=...) if it is larger)"
        )
        return Candidate(strategy, offload, ckpt, mbs[-1], largest, False, reason, None, liger, **extra)
    if host_need > host_usable:
        held = (
            ["NVMe offload's pinned buffers and gradients" if combo.nvme else "offloaded states"]
            if largest.cpu
            else []
        )
        what = " and ".join(([f"async_save's staging copy ({format_bytes(staging)})"] if staging else []) + held)
        reason = (
            f"{what} need {format_bytes(host_need)} of host RAM per node, more than the usable {format_bytes(host_usable)} "
            "(pass --host-memory / plan(host_memory_gib=...) if it is larger)"
        )
        return Candidate(strategy, offload, ckpt, mbs[-1], largest, False, reason, None, liger, **extra)
    best = None
    for mb in mbs:  # largest first; memory only grows with the micro-batch
        accum = (s.global_batch // (mb * layout.dp_size)) if s.global_batch else 1
        mem = _estimate(s, combo, mb, accum=accum)
        if mem.total > s.usable:
            continue
        time = _time(s, combo, mb, accum, mem)
        if best is None or time.tokens_per_s > best.time.tokens_per_s * (1 + TIE_FRACTION):
            best = Candidate(strategy, offload, ckpt, mb, mem, True, "", time.comm, liger, time, **extra)
    if best is not None:
        return best
    short = mem.total - s.usable
    reason = f"needs {format_bytes(mem.total)} per rank at micro_batch {mbs[-1]}, {format_bytes(short)} over the usable memory"
    # a near miss (under 1 % of the card) gets its speed, for the plan's margin note (_near_miss)
    time = _time(s, combo, mbs[-1], accum, mem) if short < 0.01 * s.hw.gpu_memory_gib * GIB else None
    return Candidate(strategy, offload, ckpt, mbs[-1], mem, False, reason, None, liger, time, **extra)


def _offload_level(c: Candidate) -> int:
    """The ladder's order of last resorts: no offload, CPU offload (optimizer, then parameters), then NVMe."""
    return OFFLOADS.index(c.offload) + (len(OFFLOADS) if c.offload_device == "nvme" else 0)


def _best(fitting: list[Candidate]) -> Candidate:
    """Least offload, then the fastest; estimates within TIE_FRACTION of it go to the simpler layout (no
    checkpointing, fewer model-parallel ranks, the registry's preference)."""
    level = min(_offload_level(c) for c in fitting)
    pool = [c for c in fitting if _offload_level(c) == level]
    fastest = max(c.tokens_per_s for c in pool)
    close = [c for c in pool if c.tokens_per_s >= fastest * (1 - TIE_FRACTION)]
    return min(
        close,
        key=lambda c: (c.activation_checkpointing, c.model_parallel, REGISTRY[c.strategy].preference, -c.tokens_per_s),
    )


def _reason_for(c: Candidate, best: Candidate, pinned: bool = False, offload_pinned: bool = False) -> str:
    if c is best:
        notes = []
        if REGISTRY[c.strategy].is_deepspeed and c.offload == "optimizer":
            notes.append("DeepSpeed because FSDP2 cannot offload only the optimizer")
        if c.offload != "none":
            where = "NVMe (ZeRO-Infinity)" if c.offload_device == "nvme" else "CPU"
            why = "as asked" if offload_pinned else "because nothing fits without it"
            notes.append(f"offload={c.offload} to {where} {why}")
        if c.model_parallel > 1 and not pinned and c.offload != "none":
            notes.append(f"{c.label.split(' ', 1)[1]} because no layout fits without offload and no data-parallel "
                         "layout fits with it")  # fmt: skip
        elif c.model_parallel > 1 and not pinned:
            notes.append(f"{c.label.split(' ', 1)[1]} because no data-parallel layout fits without offload or splits "
                         "the global batch")  # fmt: skip
        elif c.model_parallel > 1:
            notes.append(f"{c.label.split(' ', 1)[1]} as asked")
        if c.activation_checkpointing:
            notes.append("activation checkpointing: its recompute costs less than the smaller micro-batch without it")
        if c.use_liger_kernel:
            notes.append("Liger kernels: fused RMSNorm/SwiGLU/RoPE/linear cross-entropy save memory and time")
        t = c.time
        extra = ("; " + "; ".join(notes)) if notes else ""
        return (
            f"fits ({format_bytes(c.memory.total)}) with the highest estimated throughput (~{t.tokens_per_s:,.0f} tokens/s: "
            f"{t.seconds:.3f} s/step, {t.comm:.3f} s communication){extra}"
        )
    if not c.fits:
        return c.reason
    if _offload_level(c) != _offload_level(best):
        where = " to NVMe" if c.offload_device == "nvme" else ""
        return f"fits but offloads ({c.offload}{where}), which the chosen plan avoids"
    if c.tokens_per_s < best.tokens_per_s * (1 - TIE_FRACTION):
        why = []
        if c.activation_checkpointing and not best.activation_checkpointing:
            why.append("recomputes activations")
        if c.micro_batch_size < best.micro_batch_size:
            why.append(f"fits only micro_batch {c.micro_batch_size}")
        if best.use_liger_kernel and not c.use_liger_kernel:
            why.append("no Liger kernels")
        if c.time.comm > best.time.comm * (1 + TIE_FRACTION):
            why.append(f"communicates more ({c.time.comm:.3f} s/step vs {best.time.comm:.3f})")
        because = f" ({', '.join(why)})" if why else ""
        return f"fits but is slower: ~{c.tokens_per_s:,.0f} vs ~{best.tokens_per_s:,.0f} tokens/s{because}"
    return f"fits at about the same speed; {best.label} is simpler"


def _precision(hw: Hardware) -> tuple[str, int, bool]:
    """(mixed_precision, compute bytes, fp32 master weights)."""
    if hw.bf16:
        return "bf16", 2, True
    if hw.fp16:
        return "fp16", 2, True
    return "no", 4, False


def _liger_options(use_liger_kernel: bool | None, hw: Hardware) -> tuple[bool, ...]:
    """Liger kernels need CUDA (Triton) and the package; they are considered wherever both are there."""
    if use_liger_kernel is None:
        return (False, True) if hw.device == "cuda" and hw.liger_kernel else (False,)
    if not isinstance(use_liger_kernel, bool):
        raise ValueError(f"use_liger_kernel must be True, False or None (decide), got {use_liger_kernel!r}")
    if use_liger_kernel and hw.device != "cuda":
        raise ValueError(
            "use_liger_kernel=True needs CUDA GPUs (Liger's kernels are Triton), but this plan is for CPU ranks; "
            "drop use_liger_kernel, or plan for GPUs with gpu_memory_gib=..."
        )
    if use_liger_kernel and not hw.liger_kernel:
        raise ValueError(
            "use_liger_kernel=True but liger-kernel is not installed here; install it (pip install 'hf_dist[liger]') "
            "or pass detect_hardware(liger_kernel=True) when planning for a machine that has it"
        )
    return (use_liger_kernel,)


def plan(
    model: Any,
    *,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
    nodes: int | None = None,
    method: str = "full",
    seq_len: int = 2048,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    optimizer: str = "adamw",
    lora_rank: int = 16,
    strategy: str | None = None,
    offload: str | None = None,
    activation_checkpointing: bool | None = None,
    use_liger_kernel: bool | None = None,
    safety_margin: float = 0.1,
    hardware: Hardware | None = None,
    pure_bf16: bool = False,
    tp_size: int | None = None,
    cp_size: int | None = None,
    sp_size: int | None = None,
    host_memory_gib: float | None = None,
    nvme_gbps: float | None = None,
    offload_device: str | None = None,
    features: Any = None,
    fused_lm_head: bool = False,
    async_save: bool = False,
    train_tokens: int | float | None = None,
    verify: bool = False,
    verify_time_limit_s: float = 120.0,
) -> Plan:
    """Plan distributed training of ``model`` (count, config, module, folder, config.json or hub name).

    ``strategy`` / ``offload`` / ``activation_checkpointing`` / ``use_liger_kernel`` pin a choice
    instead of searching it (Liger kernels are searched on CUDA when liger-kernel is installed).
    ``pure_bf16=True`` plans bf16 weights and bf16 Adam state without fp32 master weights (less memory,
    less accurate updates); by default mixed precision keeps fp32 masters. A module's loaded dtype is
    read (``Plan.model_dtype``); dtypes other than float32/bfloat16/float16 raise ValueError.

    Model parallelism: ``tp_size`` / ``cp_size`` / ``sp_size`` pin a size (1 turns the dimension off); left
    None, the sizes the model, hardware and installed libraries allow (:mod:`hf_dist.planning.model_parallel`)
    are searched when no data-parallel layout fits without offload or the global batch is smaller than the
    GPUs. ``host_memory_gib`` (RAM per node) and ``nvme_gbps`` (the nodes' NVMe bandwidth; given, NVMe offload
    is searched when nothing else fits) describe the hardware when ``hardware`` is not passed. ``offload_device``
    pins where offloaded states go: ``"nvme"`` plans ZeRO-Infinity (ZeRO-3 only, with offload ``optimizer`` or
    ``optimizer+params``; ``Plan.swap_bytes`` is the space its swap files need per node), ``"cpu"`` never
    searches NVMe. ``features``: what
    the libraries accept (default: the installed ones, ``hf_dist.runtime.support.installed_features()``).
    ``fused_lm_head=True``: the loss runs through TRL's fused LM head (``SFTTrainer``; ``auto_args(config_class=
    SFTConfig)`` sets it), which never holds the logits. ``async_save=True``: checkpoints are staged in host RAM and
    written in the background (``attach(trainer, async_save=True)``); the staging copy counts against each node's
    host RAM (``Plan.staging_bytes``). ``train_tokens``: the tokens the run will train on; the
    plan then states the estimated wall time and GPU-hours of its choice and of the alternatives
    (:meth:`Plan.time_to_finish`). ``verify=True`` traces the chosen layout on the real model with fake tensors (:mod:`hf_dist.tracing`, seconds to
    a minute; at most ``verify_time_limit_s`` per trace) and moves to the next candidate when the trace does not fit
    (``Plan.trace``, ``Plan.verification``; docs/planner.md, "Tracing").
    Raises PlanError (a ValueError) naming the minimum hardware when nothing fits.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
    if train_tokens is not None and (
        isinstance(train_tokens, bool) or not isinstance(train_tokens, int | float) or not train_tokens >= 1
    ):
        raise ValueError(f"train_tokens must be a positive number of tokens (e.g. 2e9), got {train_tokens!r}")
    for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value in (("tp_size", tp_size), ("cp_size", cp_size), ("sp_size", sp_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int (1 = off) or None (search), got {value!r}")
    hw = hardware or detect_hardware(
        gpus=gpus, gpu_memory_gib=gpu_memory_gib, nodes=nodes, host_memory_gib=host_memory_gib, nvme_gbps=nvme_gbps
    )
    if method == "qlora" and hw.device != "cuda":
        raise ValueError("qlora needs CUDA GPUs (bitsandbytes 4-bit kernels); use method='lora' on CPU")
    if hw.device == "cpu" and offload not in (None, "none"):
        raise ValueError(f"offload {offload!r} moves states to host RAM, but training already runs on CPU; use 'none'")
    strategies = restrict("strategy", strategy, STRATEGIES)
    if offload_device == "nvme":
        strategies = _nvme_strategies(strategy, offload, method)
    elif offload_device not in (None, *OFFLOAD_DEVICES):
        raise ValueError(
            f"offload_device must be one of {list(OFFLOAD_DEVICES)} or None (search), got {offload_device!r}"
        )
    # bitsandbytes 4-bit weights stay on the GPU, so QLoRA never offloads
    no_offload = (method == "qlora" or hw.device == "cpu") and offload is None
    offloads = restrict("offload", offload, ("none",) if no_offload else OFFLOADS)
    ckpts = restrict("activation_checkpointing", activation_checkpointing, (False, True))
    ligers = _liger_options(use_liger_kernel, hw)
    if strategy is not None and hw.nodes < REGISTRY[strategy].min_nodes:
        raise ValueError(
            f"strategy {strategy!r} needs nodes >= {REGISTRY[strategy].min_nodes} (it replicates across nodes), "
            f"got nodes={hw.nodes}; use fsdp_full_shard"
        )
    from hf_dist.runtime.precision import check_pure_bf16_hardware, loaded_dtype

    check_pure_bf16_hardware(pure_bf16, hw)
    model_dtype = loaded_dtype(model)
    spec = model_spec(model)
    mp, pb, master = _precision(hw)
    master = master and not pure_bf16
    from hf_dist.planning.memory import trainable_params

    if features is None:
        from hf_dist.runtime.support import installed_features

        features = installed_features()
    setup = _Setup(
        spec, hw, method, optimizer, seq_len, lora_rank, pb, master, 4 if model_dtype == "float32" else pb,
        usable=(1 - safety_margin) * hw.gpu_memory_gib * GIB,
        trainable=trainable_params(spec, method, lora_rank),
        global_batch=global_batch_size,
        micro_batch=micro_batch_size,
        checkpoint_children=features.fsdp2_checkpoints_children,
        embedding_unit=features.fsdp2_embedding_unit,
        fused_lm_head=bool(fused_lm_head),
        async_save=bool(async_save),
    )  # fmt: skip
    options = size_options(spec, hw, seq_len, features, method=method)
    sizes_pinned = any(v is not None for v in (tp_size, cp_size, sp_size))
    pinned = pinned_sizes(spec, options, tp_size or 1, cp_size or 1, sp_size or 1) if sizes_pinned else None
    search = _Search(setup, strategies, offloads, ckpts, ligers, strategy is not None, features, offload_device)
    candidates, dims = search.run(options, pinned)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise PlanError(_nothing_fits_message(setup, search.dp_combos, candidates, dims))
    best = _best(fitting)
    for c in candidates:
        c.reason = _reason_for(
            c, best, pinned=sizes_pinned, offload_pinned=offload not in (None, "none") or bool(offload_device)
        )
    layout = best.key.layout(hw)
    global_batch = global_batch_size or best.micro_batch_size * layout.dp_size
    note = ""
    if use_liger_kernel is None and hw.device == "cuda" and not hw.liger_kernel and spec.has_shape:
        note = _liger_gain(setup, best)
    result = Plan(
        strategy=best.strategy,
        offload=best.offload,
        activation_checkpointing=best.activation_checkpointing,
        micro_batch_size=best.micro_batch_size,
        gradient_accumulation_steps=global_batch // (best.micro_batch_size * layout.dp_size),
        global_batch_size=global_batch,
        num_params=spec.num_params,
        memory=best.memory,
        candidates=candidates,
        world_size=hw.world_size,
        nodes=hw.nodes,
        method=method,
        seq_len=seq_len,
        mixed_precision=mp,
        hardware=hw,
        model=spec,
        optimizer=optimizer,
        lora_rank=lora_rank,
        reason=best.reason,
        usable_gib=setup.usable / GIB,
        use_liger_kernel=best.use_liger_kernel,
        tokens_per_s=best.tokens_per_s,
        liger_note=note,
        margin_note=_near_miss(setup, candidates, best, safety_margin),
        offload_note=_lora_without_offload(setup, best),
        pure_bf16=pure_bf16,
        model_dtype=model_dtype,
        tp_size=best.tp_size,
        cp_size=best.cp_size,
        sp_size=best.sp_size,
        offload_device=best.offload_device,
        dimensions=dims + _chosen_dimensions(best),
        load=_load(setup, best.key),
        staging_bytes=staging_per_node(setup, best.key, best.memory) if async_save else None,
        fused_lm_head=bool(fused_lm_head),
        train_tokens=None if train_tokens is None else int(train_tokens),
    )
    if not verify:
        return result
    from hf_dist.tracing.verify import verify_plan  # the tracing floor: only when asked

    return verify_plan(result, time_limit_s=verify_time_limit_s)


def _near_miss(setup: _Setup, candidates: list[Candidate], best: Candidate, safety_margin: float) -> str:
    """The fastest layout faster than ``best`` that misses the usable memory by less than 1 % of the card, with the
    safety margin that would take it; "" when there is none."""
    card = setup.hw.gpu_memory_gib * GIB
    close = [
        c for c in candidates
        if not c.fits and (c.tokens_per_s or 0) > (best.tokens_per_s or 0) and 0 < c.memory.total - setup.usable < 0.01 * card
    ]  # fmt: skip
    if not close:
        return ""
    c = max(close, key=lambda c: c.tokens_per_s or 0)
    needed = math.floor((1 - c.memory.total / card) * 1000) / 1000
    return (
        f"{c.label} misses the usable {setup.usable / GIB:.1f} GiB by {(c.memory.total - setup.usable) / GIB:.2f} GiB "
        f"(under 1 % of the card) and would run at ~{c.tokens_per_s:,.0f} vs ~{best.tokens_per_s:,.0f} tokens/s: it "
        f"fits with safety_margin={needed:g} (now {safety_margin:g}), if you trust the estimate that far"
    )


class _Search:
    """The ladder: data parallelism (with CPU offload as a last resort), then model parallelism without offload
    when no data-parallel layout fits without it or splits the global batch, then Ulysses SP with ZeRO CPU offload,
    then NVMe offload when nothing fits."""

    def __init__(self, setup: _Setup, strategies, offloads, ckpts, ligers, pinned_strategy: bool, features, device):
        self.s, self.strategies, self.offloads, self.ckpts, self.ligers = setup, strategies, offloads, ckpts, ligers
        self.pinned_strategy, self.features, self.device = pinned_strategy, features, device
        self.dp_combos = self._combos(strategies, offloads, (1, 1, 1))

    def _combos(self, strategies, offloads, *sizes) -> list[Combo]:
        hw = self.s.hw
        return _combos(strategies, offloads, self.ckpts, self.ligers, hw, self.pinned_strategy, self.features, sizes)

    def _evaluate(self, combos: list[Combo]) -> list[Candidate]:
        return [_candidate(self.s, combo) for combo in combos]

    def run(self, options, pinned: tuple[int, int, int] | None) -> tuple[list[Candidate], list[str]]:
        hw, dims = self.s.hw, [f"{n}: {why}" for n, why in options.unavailable.items()]
        if self.device == "nvme":
            return self._nvme([pinned or (1, 1, 1)]), dims + ["nvme: offload_device='nvme' was asked for"]
        if pinned is not None:
            combos = self._combos(self.strategies, self.offloads, pinned)
            if not combos:
                raise ValueError(self._no_layout_for(pinned))
            return self._evaluate(combos), dims
        if not self.dp_combos:
            raise ValueError(f"no strategy among {list(self.strategies)} can use offload {list(self.offloads)}")
        candidates = self._evaluate(self.dp_combos)
        if any(c.fits and c.offload == "none" for c in candidates):
            return candidates, dims + ["tp/cp/sp not searched: a data-parallel layout fits without offload"]
        if "none" not in self.offloads:
            return candidates, dims + ["tp/cp/sp not searched: offload was asked for (model parallelism is searched "
                                       "without offload)"]  # fmt: skip
        triples = options.triples(hw.world_size)
        mp = self._combos(self.strategies, ("none",), *triples)
        candidates += self._evaluate(mp)
        dims.append(f"searched {options.describe()} ({len(mp)} layouts) because no data-parallel layout fits "
                    "without offload" + self._batch_note(candidates))  # fmt: skip
        if any(c.fits for c in candidates):
            return candidates, dims
        if self.offloads == ("none",):
            return candidates, dims + ["offload with sp, nvme: not searched: offload is 'none' here (asked for, "
                                       "QLoRA or CPU ranks)"]  # fmt: skip
        seq = [t for t in triples if t[0] == t[1] == 1]  # Ulysses SP alone
        offloads = [o for o in ("optimizer", "optimizer+params") if o in self.offloads]  # unless offload is pinned
        # ZeRO CPU offload with Ulysses SP: DeepSpeed ALST's recipe for long sequences on few GPUs
        zero = [name for name in self.strategies if REGISTRY[name].is_deepspeed]
        offloaded = self._combos(zero, offloads, *seq)
        candidates += self._evaluate(offloaded)
        dims.append(f"searched sp with ZeRO CPU offload ({len(offloaded)} layouts, DeepSpeed ALST's recipe): nothing "
                    "fits without offload")  # fmt: skip
        if any(c.fits for c in candidates):
            return candidates, dims
        if self.device == "cpu":
            return candidates, dims + ["nvme: not searched: offload_device='cpu' was asked for"]
        if hw.nvme_gbps is None:
            return candidates, dims + ["nvme: not searched: pass nvme_gbps (hf-dist plan --nvme-gbps) for the "
                                       "nodes' local NVMe drives to consider ZeRO-Infinity"]  # fmt: skip
        nvme = self._nvme([(1, 1, 1), *seq])
        return candidates + nvme, dims + [
            f"nvme: searched zero3 offload to NVMe ({len(nvme)} layouts): nothing else fits"
        ]

    def _nvme(self, sizes) -> list[Candidate]:
        """ZeRO-3 with its optimizer (and parameters) offloaded to NVMe, with the ``sizes`` (tp, cp, sp) triples."""
        zero3 = ["zero3"] if "zero3" in self.strategies else []
        offloads = [o for o in ("optimizer", "optimizer+params") if o in self.offloads]
        nvme = [c._replace(nvme=True) for c in self._combos(zero3, offloads, *sizes)]
        return self._evaluate([c for c in nvme if _refusal(c, self.s.hw, self.features) is None])

    def _no_layout_for(self, sizes) -> str:
        """Why no strategy runs the pinned sizes: the library's own reason when one strategy was asked for."""
        tp, cp, sp = sizes
        if self.pinned_strategy:
            combo = Combo(self.strategies[0], "none", False, False, tp, cp, sp)
            reason = _refusal(combo, self.s.hw, self.features)
            if reason:
                return reason
        hw = self.s.hw
        return (
            f"no layout runs tp_size={tp} cp_size={cp} sp_size={sp} with strategy {'/'.join(self.strategies)} on "
            f"{hw.world_size} GPU(s) in {hw.nodes} node(s): TP needs FSDP2 (or DDP with nothing replicated, or "
            "zero1/zero2 AutoTP) inside a node, CP needs FSDP2, SP needs DeepSpeed ZeRO, and their product must "
            "divide the world size"
        )

    def _batch_note(self, candidates: list[Candidate]) -> str:
        split = [c for c in candidates if c.model_parallel == 1 and "global_batch" in c.reason]
        return f" or splits the global batch ({split[0].reason.split(';')[0]})" if split else ""


def _nvme_strategies(strategy: str | None, offload: str | None, method: str) -> tuple[str, ...]:
    """The strategies ``offload_device="nvme"`` leaves: ZeRO-3 only (DeepSpeed swaps to NVMe in stage 3 alone)."""
    if strategy not in (None, "zero3"):
        raise ValueError(
            f"offload_device='nvme' with strategy {strategy!r}: NVMe offload (ZeRO-Infinity) is DeepSpeed ZeRO-3's "
            "(ZeRO-1/2 and FSDP2 offload to CPU memory only); use strategy='zero3', or offload_device='cpu'"
        )
    if offload == "none" or method == "qlora":
        raise ValueError(
            f"offload_device='nvme' needs offload 'optimizer' or 'optimizer+params', got "
            f"{'method qlora (4-bit weights stay on the GPU)' if method == 'qlora' else 'offload none'}"
        )
    return ("zero3",)


def _chosen_dimensions(best: Candidate) -> list[str]:
    if best.model_parallel == 1 and best.offload_device != "nvme":
        return []
    return [f"chosen {best.label}: {best.reason.split('; ', 1)[-1]}"]


def _liger_gain(s: _Setup, best: Candidate) -> str:
    """What Liger kernels would change for the chosen layout, when the package is missing."""
    strategy = best.strategy
    options = [_candidate(s, best.key._replace(ckpt=ckpt, liger=True)) for ckpt in (False, True)]
    fitting = [c for c in options if c.fits]
    if not fitting:
        return ""
    alt = _best(fitting)
    gain = alt.tokens_per_s / best.tokens_per_s - 1
    if gain <= TIE_FRACTION:
        return ""
    return (
        f"not installed; with liger-kernel (pip install 'hf_dist[liger]') {strategy} would fit micro_batch "
        f"{alt.micro_batch_size}{' with checkpointing' if alt.activation_checkpointing else ''} at "
        f"{format_bytes(alt.memory.total)} and run ~{gain:.0%} faster (~{alt.tokens_per_s:,.0f} tokens/s)"
    )


def _lora_without_offload(s: _Setup, best: Candidate) -> str:
    """When a LoRA plan offloads: what QLoRA (a 4-bit base) or Liger's kernels would fit without offload, each
    with its speed; "" otherwise."""
    if s.method != "lora" or best.offload == "none" or s.hw.device != "cuda":
        return ""
    from dataclasses import replace

    from hf_dist.planning.memory import trainable_params

    qlora = replace(s, method="qlora", trainable=trainable_params(s.spec, "qlora", s.lora_rank))
    q_how = "QLoRA (method='qlora', a 4-bit base; bitsandbytes)"
    l_how = "Liger's kernels (use_liger_kernel=True" + (
        ")" if s.hw.liger_kernel else "; pip install 'hf_dist[liger]')"
    )
    ways = [(qlora, False, q_how)]
    if not best.use_liger_kernel:
        ways += [(s, True, l_how), (qlora, True, f"{q_how} with {l_how}")]
    ways = [(setup, best.key._replace(offload="none", ckpt=ckpt, liger=liger or best.use_liger_kernel), how)
            for setup, liger, how in ways for ckpt in (False, True)]  # fmt: skip
    notes = {}
    for setup, combo, how in ways:
        c = _candidate(setup, combo)
        if c.fits and (how not in notes or (c.tokens_per_s or 0) > (notes[how].tokens_per_s or 0)):
            notes[how] = c
    offloaded = f" (offloaded: ~{best.tokens_per_s:,.0f} tokens/s)" if best.tokens_per_s else ""
    return "; ".join(
        f"{how} would fit without offload: micro_batch {c.micro_batch_size}"
        f"{' with checkpointing' if c.activation_checkpointing else ''} at {format_bytes(c.memory.total)}"
        + (f", ~{c.tokens_per_s:,.0f} tokens/s" if c.tokens_per_s else "")
        for how, c in notes.items()
    ) + (offloaded if notes else "")


# ---------------------------------------------------------------- when nothing fits


def _nothing_fits_message(s: _Setup, combos, candidates: list[Candidate], dims: list[str]) -> str:
    """Why nothing fits and what would, one finding a line."""
    hw = s.hw
    model_parallel = [d for d in dims if not d.startswith("tp/cp/sp not searched")]
    batch = [c for c in candidates if c.reason.startswith("global_batch")]
    if len(batch) == len(candidates):  # no layout can split the batch: the arithmetic is the message
        return _lines(candidates[0].reason, [f"model parallelism: {d}" for d in model_parallel])
    # the GPU memory that would suffice is stated for plans without offload (offload also needs host RAM)
    smallest = min([c for c in candidates if c.offload == "none"] or candidates, key=lambda c: c.memory.total)
    margin = s.usable / (hw.gpu_memory_gib * GIB)
    findings = []
    if smallest.memory.total > s.usable:
        findings.append(
            f"the smallest candidate ({smallest.label}, micro_batch={smallest.micro_batch_size}) needs "
            f"{format_bytes(smallest.memory.total)} per rank (usable {format_bytes(s.usable)}); it would fit with "
            f"{smallest.memory.total / margin / GIB:.0f} GiB per GPU"
        )
    for nvme in (False, True):  # the least host RAM any CPU / NVMe offload layout asks for
        host = [
            c for c in candidates
            if c.offload != "none" and "of host RAM per node" in c.reason and (c.offload_device == "nvme") == nvme
        ]  # fmt: skip
        if host:
            least = min(host, key=lambda c: c.memory.cpu)
            findings.append(f"with {'NVMe' if nvme else 'CPU'} offload ({least.label}) the {least.reason}")
    findings += [f"model parallelism: {d}" if not d.startswith("nvme:") else d for d in model_parallel]
    head = f"nothing fits on {hw.world_size} x {hw.gpu_memory_gib:.0f} GiB"
    if _needs_tensor_parallel(s):
        findings.append(
            f"a single decoder layer ({s.spec.layer_params / 1e6:.0f}M params) with its gradients and activations "
            "does not fit on one GPU even with full sharding: it needs tensor parallelism (above) or, beyond one "
            "node's GPUs, pipeline parallelism (not covered by hf_dist)"
        )
        return _lines(head, findings)
    fully_sharded = [c for c in combos if REGISTRY[c[0]].shards.params and not REGISTRY[c[0]].gathers_params]
    found = _min_world(s, fully_sharded or combos)
    if found is None:
        findings.append("no data-parallel world size up to 8192 GPUs fits: use tensor/pipeline parallelism")
    else:
        world, nodes, combo = found
        findings.append(
            f"it would fit on at least {world} GPUs of {hw.gpu_memory_gib:.0f} GiB ({nodes} node(s)) with {combo[0]}, "
            f"offload={combo[1]}, activation_checkpointing={combo[2]}"
        )
    return _lines(head, findings)


def _lines(head: str, findings: list[str]) -> str:
    """``head:`` and one ``  - finding`` a line (``head`` alone without findings)."""
    return head + ":" + "".join(f"\n  - {f}" for f in findings) if findings else head


def _needs_tensor_parallel(s: _Setup) -> bool:
    from hf_dist.planning.activations import layer_activation_bytes

    if not s.spec.has_shape:
        return False
    from hf_dist.planning.memory import engine_dtypes

    lay = engine_dtypes(REGISTRY["fsdp_full_shard"], s.pb, s.master, s.method, s.base_bytes)
    trainable_layer = s.spec.layer_params if s.method == "full" else 0
    layer = s.spec.layer_params * s.pb + trainable_layer * lay.grads
    acts = layer_activation_bytes(s.spec, s.seq_len, 1, lay)
    return layer + acts > s.usable


def _min_world(s: _Setup, combos) -> tuple[int, int, tuple] | None:
    """Smallest world size (same GPUs per node; nodes of 8 beyond one node) on which a combo fits at micro_batch 1."""
    per_node = max(s.hw.gpus_per_node, 8)
    sizes = [(w, 1) for w in range(s.hw.world_size + 1, per_node + 1)]
    sizes += [(per_node * k, k) for k in range(2, 8192 // per_node + 1)]
    for level in OFFLOADS:  # the fewest GPUs without offload if possible, else with the least offload
        best = None
        for combo in (c for c in combos if c[1] == level):
            # memory per rank only falls as the world grows, so bisect over the ordered sizes
            if not sizes or not _fits_at(s, combo, sizes[-1]):
                continue
            lo, hi = 0, len(sizes) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if _fits_at(s, combo, sizes[mid]):
                    hi = mid
                else:
                    lo = mid + 1
            if best is None or lo < best[0]:
                best = (lo, combo)
        if best is not None:
            return sizes[best[0]][0], sizes[best[0]][1], best[1]
    return None


def _fits_at(s: _Setup, combo: Combo, size: tuple[int, int]) -> bool:
    world, nodes = size
    if nodes < REGISTRY[combo[0]].min_nodes:
        return False
    return _estimate(s, combo, 1, world=world, nodes=nodes).total <= s.usable
