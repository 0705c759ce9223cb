"""One searched combination (strategy, offload, checkpointing, Liger, tp/cp/sp sizes) made a candidate: the
micro-batch options of the batch split, its memory, host RAM at load and for async_save, and its estimated speed.

:class:`Setup` is the run every candidate shares; :func:`combos` enumerates the combinations a search asks for,
leaving out those a layout or the installed libraries refuse (:func:`refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist.planning.choice import TIE_FRACTION
from hf_dist.planning.dtypes import GIB, engine_dtypes
from hf_dist.planning.features import check_features
from hf_dist.planning.hardware import Hardware
from hf_dist.planning.layout import REGISTRY
from hf_dist.planning.load_memory import LoadMemory, load_memory
from hf_dist.planning.lora_plan import Placement
from hf_dist.planning.memory import estimate_memory
from hf_dist.planning.memory_estimate import MemoryEstimate
from hf_dist.planning.model_parallel import micro_batch_limit
from hf_dist.planning.modelinfo import ModelSpec
from hf_dist.planning.plan_result import Candidate, Combo, format_bytes
from hf_dist.planning.throughput import StepTime, comm_seconds, model_parallel_seconds, nvme_seconds, step_time

MAX_MICRO_BATCH = 16


def micro_batch_options(global_batch, micro_batch, world, limit: tuple[int, str] | None = None) -> list[int]:
    """Micro-batch sizes to try, largest first, each dividing global / world (the data-parallel ranks) and, for a
    layout that runs only micro-batches up to a size (``limit``: that size and why), at most that size; a pinned
    micro-batch above it is refused with the arithmetic that keeps the global batch."""
    cap = min(limit[0], MAX_MICRO_BATCH) if limit else MAX_MICRO_BATCH
    if micro_batch is not None:
        if limit and micro_batch > limit[0]:
            raise ValueError(_over_limit(global_batch or micro_batch * world, micro_batch, world, limit))
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
    return [m for m in range(min(per_rank, cap), 0, -1) if per_rank % m == 0]


def batch_refusal(global_batch: int, micro_batch: int | None, world: int) -> str:
    """Why ``global_batch`` cannot be split over ``world`` data-parallel ranks (at ``micro_batch`` when pinned), with
    the arithmetic and the nearest global batches that can: one line."""
    step = (micro_batch or 1) * world
    ranks = f"micro_batch_size {micro_batch} x {world} data-parallel ranks = {step}" if micro_batch else (
        f"the {world} data-parallel ranks")  # fmt: skip
    below, above = global_batch // step * step, (global_batch // step + 1) * step
    nearest = f"{below} or {above}" if below else f"{above}"
    return (
        f"global_batch_size {global_batch} is not divisible by {ranks} ({global_batch} = {global_batch // step} x "
        f"{step} + {global_batch % step}), and a data-parallel layout fits without splitting the model; use "
        f"global_batch_size {nearest} (a multiple of {step}), or pin tp_size / cp_size / sp_size to split the model "
        "instead"
    )


def _over_limit(global_batch: int, micro_batch: int, world: int, limit: tuple[int, str]) -> str:
    """Why a pinned ``micro_batch`` above ``limit`` is refused, and the split that keeps ``global_batch``."""
    cap, why = limit
    per_rank = max(global_batch // world, 1)
    fix = next(m for m in range(min(cap, per_rank), 0, -1) if per_rank % m == 0)
    accum = per_rank // fix
    return (
        f"micro_batch_size {micro_batch} (per_device_train_batch_size) cannot run: {why}.\n"
        f"  To keep the global batch: micro_batch {fix} x gradient_accumulation_steps {accum} x data_parallel {world} "
        f"= {global_batch}; pass micro_batch_size {fix} with gradient_accumulation_steps {accum}, or "
        f"global_batch_size {global_batch} alone"
    )


@dataclass(frozen=True)
class Setup:
    spec: ModelSpec
    hw: Hardware
    method: str
    optimizer: str
    seq_len: int
    lora: Placement | None  # where the LoRA's adapters go (method lora/qlora)
    pb: int
    master: bool
    base_bytes: int  # a LoRA model's frozen base as loaded: 4 for fp32, else 2
    usable: float
    trainable: int
    global_batch: int | None = None
    micro_batch: int | None = None
    checkpoint_children: bool = False  # LibraryFeatures.fsdp2_checkpoints_children
    embedding_unit: bool = True  # LibraryFeatures.fsdp2_embedding_unit
    fused_lm_head: bool = False  # TRL's fused LM head computes the loss (planning/head_activations.trl_head_bytes)
    async_save: bool = False  # checkpoints staged in host RAM, then written in the background


def estimate(s: Setup, combo: Combo, mb, world=None, nodes=None, accum=1) -> MemoryEstimate:
    return estimate_memory(
        s.spec, combo.strategy, world or s.hw.world_size, nodes=nodes or s.hw.nodes, method=s.method,
        offload=combo.offload, optimizer=s.optimizer, master_weights=s.master, base_bytes=s.base_bytes,
        param_bytes=s.pb, seq_len=s.seq_len, micro_batch_size=mb, activation_checkpointing=combo.ckpt,
        lora=s.lora, gradient_accumulation_steps=accum, use_liger_kernel=combo.liger, device=s.hw.device,
        tp_size=combo.tp, cp_size=combo.cp, sp_size=combo.sp, offload_device="nvme" if combo.nvme else "cpu",
        checkpoint_children=s.checkpoint_children, fsdp2_embedding_unit=s.embedding_unit,
        fused_lm_head=s.fused_lm_head, sync_each_batch=combo.sync,
    )  # fmt: skip


def step_seconds(s: Setup, combo: Combo, mb: int, accum: int, memory: MemoryEstimate) -> StepTime:
    hw, layout = s.hw, combo.layout(s.hw)
    strategy = REGISTRY[combo.strategy]
    spec = layout.rank_spec(s.spec)  # what one rank of a TP group holds and computes
    trainable = s.trainable // combo.tp
    grad_bytes = 4 if s.pb == 4 else 2  # what the collectives move (DeepSpeed reduces in the compute dtype)
    # the data-parallel collectives run over the ranks that hold the same TP slice
    comm = comm_seconds(strategy, combo.offload, spec, trainable, hw.world_size // combo.tp, hw.nodes, accum, s.pb,
                        grad_bytes, hw, sync_each_batch=combo.sync)  # fmt: skip
    comm += model_parallel_seconds(layout, s.spec, s.seq_len, mb, hw, combo.ckpt) * accum
    if combo.nvme:
        comm += nvme_seconds(s.spec, s.trainable, combo.offload, accum, s.pb, hw)
    return step_time(
        spec, hw, memory, strategy=strategy, offload=combo.offload, trainable=trainable, micro_batch_size=mb,
        accumulation=accum, seq_len=s.seq_len, activation_checkpointing=combo.ckpt, use_liger_kernel=combo.liger,
        comm=comm, dp_size=layout.dp_size, seq_shards=layout.seq_shards, tp_size=combo.tp,
        lora_adapters=s.lora.adapters_per_layer if s.lora else 0, lora_dropout=bool(s.lora and s.lora.lora.dropout),
    )  # fmt: skip


def combos(
    strategies, offloads, ckpts, ligers, hw: Hardware, pinned: bool, features, sizes=((1, 1, 1),), syncs=(False,)
) -> list[Combo]:
    """Every allowed combination. On one GPU there is nothing to shard: a sharding engine is only
    searched with offload (it would add its overhead for nothing), unless the strategy is pinned.
    ``sizes``: the (tp, cp, sp) triples to combine with them; those a layout or the installed libraries
    (``features``) refuse are left out. ``syncs``: the ``sync_each_batch`` options of FSDP2 strategies (the others
    never hold unsharded gradients across micro-batches)."""
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
                        for sync in syncs if s.is_fsdp else (False,):
                            combo = Combo(name, offload, ckpt, liger, tp, cp, sp, sync=sync)
                            if refusal(combo, hw, features) is None:
                                out.append(combo)
    return out


def accumulates(s: Setup, combo: Combo, hw: Hardware) -> bool:
    """Whether some micro-batch of ``combo`` accumulates gradients over micro-batches (sync_each_batch matters)."""
    if s.global_batch is None:
        return False
    dp = combo.layout(hw).dp_size
    per_rank = s.global_batch // dp if s.global_batch % dp == 0 else 0
    return per_rank > (s.micro_batch or 1)


def refusal(combo: Combo, hw: Hardware, features) -> str | None:
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


def load_for(s: Setup, combo: Combo) -> LoadMemory:
    """Host RAM while ``combo``'s engine loads the model: each rank holds the plan's weight dtype (a LoRA model's
    frozen base: as loaded) until the engine moves the weights to the device."""
    held = engine_dtypes(combo.strategy, s.pb, s.master).weights if s.method == "full" else s.base_bytes
    return load_memory(
        s.spec.num_params, combo.strategy, held_bytes=held, checkpoint_bytes=s.spec.checkpoint_bytes,
        ranks_per_node=s.hw.gpus_per_node, tp_size=combo.tp,
    )  # fmt: skip


def staging_per_node(s: Setup, combo: Combo, mem: MemoryEstimate) -> int:
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


def candidate(s: Setup, combo: Combo) -> Candidate:
    layout = combo.layout(s.hw)
    try:
        limit = micro_batch_limit(s.hw.device, combo.sp)
        mbs = micro_batch_options(s.global_batch, s.micro_batch, layout.dp_size, limit)
    except ValueError as e:
        mem = estimate(s, combo, s.micro_batch or 1)
        return Candidate(combo, s.micro_batch or 1, mem, False, str(e), None)
    largest = estimate(s, combo, mbs[-1])
    staging = staging_per_node(s, combo, largest)
    host_need = largest.cpu * s.hw.gpus_per_node + staging
    host_usable = s.usable / (s.hw.gpu_memory_gib * GIB) * s.hw.host_memory_limit_gib * GIB
    load = load_for(s, combo)
    if s.hw.device != "cpu" and load.per_node > host_usable:
        reason = (
            f"loading needs {load.text()}, more than the usable {format_bytes(host_usable)} of host RAM per node "
            "(ZeRO-3 reads the weights on rank 0 only; pass --host-memory / plan(host_memory_gib=...) if it is larger)"
        )
        return Candidate(combo, mbs[-1], largest, False, reason, None)
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
        return Candidate(combo, mbs[-1], largest, False, reason, None)
    best = None
    for mb in mbs:  # largest first; memory only grows with the micro-batch
        accum = (s.global_batch // (mb * layout.dp_size)) if s.global_batch else 1
        if combo.sync and accum == 1:  # nothing accumulates: the same run as without sync_each_batch
            continue
        mem = estimate(s, combo, mb, accum=accum)
        if mem.total > s.usable:
            continue
        time = step_seconds(s, combo, mb, accum, mem)
        if best is None or time.tokens_per_s > best.time.tokens_per_s * (1 + TIE_FRACTION):
            best = Candidate(combo, mb, mem, True, "", time.comm, time)
    if best is not None:
        return best
    short = mem.total - s.usable
    reason = f"needs {format_bytes(mem.total)} per rank at micro_batch {mbs[-1]}, {format_bytes(short)} over the usable memory"
    # a near miss (under 1 % of the card) gets its speed, for the plan's margin note (near_miss)
    time = step_seconds(s, combo, mbs[-1], accum, mem) if short < 0.01 * s.hw.gpu_memory_gib * GIB else None
    return Candidate(combo, mbs[-1], mem, False, reason, None, time)
