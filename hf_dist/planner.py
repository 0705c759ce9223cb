"""Choose the distributed strategy: the fastest one that fits, with a reason for every alternative.

Rules, in order (each candidate's ``reason`` says which one decided):
1. A candidate fits when its per-rank total <= (1 - safety_margin) * GPU memory.
2. Avoid CPU offload, then activation checkpointing, unless nothing fits without them.
3. Among the rest, the lowest per-step communication time (``comm_seconds``).
4. Ties go to the simpler strategy (``PREFERENCE``). At the same sharding level FSDP2 comes before
   DeepSpeed: FSDP2 is native to the Trainer on transformers 5 (no extra dependency, DCP
   checkpoints). DeepSpeed ZeRO wins when it is cheaper (ZeRO-1/2 all-gather once per optimizer step)
   or when only the optimizer must be offloaded (FSDP2 offloads parameters and optimizer together).
Each (strategy, offload, checkpointing) uses the largest micro-batch that fits; gradient accumulation
keeps the global batch: global = micro * accumulation * world.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hf_dist.hardware import Hardware, detect_hardware
from hf_dist.memory import ALLOWED_OFFLOADS, GIB, METHODS, OFFLOADS, STRATEGIES, MemoryEstimate, estimate_memory
from hf_dist.modelinfo import ModelSpec, model_spec

# simplest first; ties in communication time go to the earlier one
PREFERENCE = ("ddp", "zero1", "fsdp_shard_grad_op", "zero2", "fsdp_full_shard", "zero3", "hsdp")
# Link bandwidths when the hardware does not say (GB/s per device, achieved bus bandwidth):
# NVLink-class nodes reach ~150 GB/s in NCCL all-reduce bus bandwidth; a 200 Gb/s NIC per GPU
# (InfiniBand / EFA) ~25 GB/s; PCIe 4.0 x16 host<->device ~25 GB/s.
DEFAULT_INTRA_GBPS = 150.0
DEFAULT_INTER_GBPS = 25.0
PCIE_GBPS = 25.0
MAX_MICRO_BATCH = 16


def _fmt(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if abs(num_bytes) >= GIB else f"{num_bytes / 1024**2:.1f} MiB"


class PlanError(ValueError):
    """Nothing fits; the message names the minimum hardware that would."""


@dataclass
class Candidate:
    strategy: str
    offload: str
    activation_checkpointing: bool
    micro_batch_size: int
    memory: MemoryEstimate
    fits: bool
    reason: str
    comm_seconds: float | None


@dataclass
class Plan:
    strategy: str
    offload: str
    activation_checkpointing: bool
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    num_params: int
    memory: MemoryEstimate
    candidates: list[Candidate]
    world_size: int
    nodes: int
    method: str
    seq_len: int
    mixed_precision: str  # "bf16" | "fp16" | "no"
    hardware: Hardware
    model: ModelSpec
    optimizer: str
    lora_rank: int
    reason: str = ""
    usable_gib: float = field(default=0.0)
    pure_bf16: bool = False  # bf16 weights and Adam state, no fp32 master weights (only when asked for)
    model_dtype: str | None = None  # dtype the given module was loaded in; None for a name/config/count

    @property
    def optimizer_state_dtype(self) -> str:
        """dtype of the master weights and Adam state: "bfloat16" under pure bf16, else "float32"."""
        return "bfloat16" if self.pure_bf16 else "float32"

    def _precision_text(self) -> str:
        if self.pure_bf16:
            return "bf16 (pure bf16: bf16 weights and Adam state, no fp32 master weights)"
        if self.mixed_precision == "no":
            return "fp32"
        return f"{self.mixed_precision} mixed precision (fp32 master weights and Adam state)"

    def to_dict(self) -> dict:
        """JSON-serializable summary (the transformers config object is left out)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("memory", "candidates", "hardware", "model")}
        out["memory"] = self.memory.to_dict()
        out["optimizer_state_dtype"] = self.optimizer_state_dtype
        out["hardware"] = self.hardware.to_dict()
        out["model"] = {k: v for k, v in asdict(self.model).items() if k != "config"}
        out["candidates"] = [
            {**{k: v for k, v in asdict(c).items() if k != "memory"}, "memory": c.memory.to_dict()}
            for c in self.candidates
        ]
        json.dumps(out)  # fail here, not in the caller, if something is not serializable
        return out

    def explain(self) -> str:
        """A readable table of every candidate by component (GiB per rank) with its verdict and reason."""
        hw = self.hardware
        size = f"{self.num_params / 1e9:.2f}B" if self.num_params >= 1e9 else f"{self.num_params / 1e6:.2f}M"
        # small models read better in MiB
        unit, div = ("GiB", GIB) if max(c.memory.total for c in self.candidates) >= GIB else ("MiB", 1024**2)
        lines = [
            f"model: {self.model.name or 'model'} ({size} params), method={self.method}, optimizer={self.optimizer}, "
            f"seq_len={self.seq_len}, precision={self._precision_text()}"
            + (f", model loaded in {self.model_dtype}" if self.model_dtype else ""),
            f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} {hw.gpu_name or hw.device} "
            f"({hw.gpu_memory_gib:.1f} GiB, usable {self.usable_gib:.1f} GiB after safety margin)",
            f"chosen: {self.strategy}, offload={self.offload}, activation_checkpointing={self.activation_checkpointing}, "
            f"micro_batch={self.micro_batch_size} x accumulation={self.gradient_accumulation_steps} x world="
            f"{self.world_size} = global_batch {self.global_batch_size}",
            f"why: {self.reason}",
            f"per-rank memory in {unit}:",
        ]
        header = ("strategy", "offload", "ckpt", "mb", "params", "grads", "optim", "acts", "buffers", "overhead")
        header += ("total", "comm_s", "verdict")
        rows = [header]
        for c in self.candidates:
            m = c.memory
            chosen = (c.strategy, c.offload, c.activation_checkpointing) == (
                self.strategy,
                self.offload,
                self.activation_checkpointing,
            )
            verdict = "CHOSEN" if chosen else ("fits" if c.fits else "no fit")
            gib = [f"{v / div:.2f}" for v in (m.params, m.grads, m.optimizer, m.activations, m.buffers, m.overhead)]
            comm = "-" if c.comm_seconds is None else f"{c.comm_seconds:.3f}"
            ckpt = "yes" if c.activation_checkpointing else "no"
            rows.append(
                (c.strategy, c.offload, ckpt, str(c.micro_batch_size), *gib, f"{m.total / div:.2f}", comm, verdict)
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for row in rows:
            cells = [
                cell.rjust(w) if i >= 3 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells))
        lines.append("")
        lines.append("reasons:")
        for c in self.candidates:
            ckpt = "+ckpt" if c.activation_checkpointing else ""
            lines.append(f"  {c.strategy}/{c.offload}{ckpt}: {c.reason}")
        return "\n".join(lines)


# ---------------------------------------------------------------- communication model


def comm_seconds(strategy, offload, spec, trainable, world, nodes, accum, pb, gb, hw: Hardware) -> float:
    """Per optimizer step, per rank, seconds spent moving bytes (ring collectives, bandwidth-bound).

    Ring all-reduce moves 2(N-1)/N of the buffer per rank, reduce-scatter and all-gather (N-1)/N each
    (Patarasuk & Yuan 2009; NCCL performance docs). DDP and ZeRO-1 reduce once per optimizer step
    (no_sync / local accumulation); ZeRO-2 reduce-scatters each micro-step; FSDP and ZeRO-3 gather
    parameters in forward and backward (FSDP2 shard-grad-op only in forward) and reduce-scatter
    gradients on every micro-step.
    """
    intra = (hw.intra_node_gbps or DEFAULT_INTRA_GBPS) * 1e9
    inter = (hw.inter_node_gbps or DEFAULT_INTER_GBPS) * 1e9
    link = inter if nodes > 1 else intra
    params, grads = spec.num_params * pb, trainable * gb
    seconds = 0.0
    if world > 1:
        f = (world - 1) / world
        if strategy == "ddp":
            seconds = 2 * f * grads / link
        elif strategy == "zero1":
            seconds = f * (grads + params) / link
        elif strategy == "zero2":
            seconds = (f * grads * accum + f * params) / link
        elif strategy == "fsdp_shard_grad_op":
            seconds = f * (params + grads) * accum / link
        elif strategy in ("zero3", "fsdp_full_shard"):
            seconds = f * (2 * params + grads) * accum / link
        elif strategy == "hsdp":
            g = world // nodes
            fi, fo = (g - 1) / g, (nodes - 1) / nodes
            seconds = (fi * (2 * params + grads) / intra + 2 * fo * grads / g / inter) * accum
    if offload != "none":
        # gradients to the host and updated parameters back, every optimizer step, over PCIe
        degree = world // nodes if strategy == "hsdp" else world
        seconds += (trainable * (gb + pb)) / degree / (PCIE_GBPS * 1e9)
        if offload == "optimizer+params":
            seconds += 2 * params / degree * accum / (PCIE_GBPS * 1e9)
    return seconds


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
    gb: int
    master: bool
    usable: float
    trainable: int


def _estimate(s: _Setup, strategy, offload, ckpt, mb, world=None, nodes=None, accum=1) -> MemoryEstimate:
    cpu = s.hw.device == "cpu"
    return estimate_memory(
        s.spec,
        strategy,
        world or s.hw.world_size,
        nodes=nodes or s.hw.nodes,
        method=s.method,
        offload=offload,
        optimizer=s.optimizer,
        master_weights=s.master,
        param_bytes=s.pb,
        grad_bytes=s.gb,
        seq_len=s.seq_len,
        micro_batch_size=mb,
        activation_checkpointing=ckpt,
        lora_rank=s.lora_rank,
        overhead=0 if cpu else None,
        gradient_accumulation_steps=accum,
    )


def _combos(strategies, offloads, ckpts, nodes) -> list[tuple[str, str, bool]]:
    out = []
    for offload in offloads:
        for ckpt in ckpts:
            for strategy in strategies:
                if strategy == "hsdp" and nodes < 2:
                    continue
                if offload in ALLOWED_OFFLOADS[strategy]:
                    out.append((strategy, offload, ckpt))
    return out


def _candidate(s: _Setup, strategy, offload, ckpt, mbs, global_batch) -> Candidate:
    world, nodes = s.hw.world_size, s.hw.nodes
    host_need = _estimate(s, strategy, offload, ckpt, mbs[-1]).cpu * s.hw.gpus_per_node
    host_usable = s.usable / (s.hw.gpu_memory_gib * GIB) * s.hw.host_memory_limit_gib * GIB
    if host_need > host_usable:
        mem = _estimate(s, strategy, offload, ckpt, mbs[-1])
        reason = (
            f"offloaded states need {_fmt(host_need)} of host RAM per node, more than the usable {_fmt(host_usable)} "
            "(pass --host-memory / detect_hardware(host_memory_gib=...) if it is larger)"
        )
        return Candidate(strategy, offload, ckpt, mbs[-1], mem, False, reason, None)
    for mb in mbs:
        accum = (global_batch // (mb * world)) if global_batch else 1
        mem = _estimate(s, strategy, offload, ckpt, mb, accum=accum)
        if mem.total <= s.usable:
            comm = comm_seconds(strategy, offload, s.spec, s.trainable, world, nodes, accum, s.pb, s.gb, s.hw)
            return Candidate(strategy, offload, ckpt, mb, mem, True, "", comm)
    short = mem.total - s.usable
    reason = f"needs {_fmt(mem.total)} per rank at micro_batch {mbs[-1]}, {_fmt(short)} over the usable memory"
    return Candidate(strategy, offload, ckpt, mbs[-1], mem, False, reason, None)


def _rank(c: Candidate) -> tuple:
    return (
        OFFLOADS.index(c.offload),
        c.activation_checkpointing,
        round(c.comm_seconds, 6),
        PREFERENCE.index(c.strategy),
    )


def _reason_for(c: Candidate, best: Candidate) -> str:
    if c is best:
        fsdp_note = ""
        if c.strategy.startswith("fsdp") or c.strategy == "hsdp":
            fsdp_note = "; FSDP2 is preferred at equal cost because it is native to the Trainer"
        if c.strategy.startswith("zero") and c.offload == "optimizer":
            fsdp_note = "; DeepSpeed because FSDP2 cannot offload only the optimizer"
        extras = []
        if c.offload != "none":
            extras.append(f"offload={c.offload} because nothing fits without it")
        if c.activation_checkpointing:
            extras.append("activation checkpointing because nothing fits without it")
        extra = ("; " + "; ".join(extras)) if extras else ""
        return f"fits ({_fmt(c.memory.total)}) with the lowest communication time ({c.comm_seconds:.3f} s/step){extra}{fsdp_note}"
    if not c.fits:
        return c.reason
    if c.offload != best.offload:
        return f"fits but uses CPU offload ({c.offload}), which the chosen plan avoids"
    if c.activation_checkpointing != best.activation_checkpointing:
        return "fits but recomputes activations, which the chosen plan avoids"
    if c.comm_seconds > best.comm_seconds + 1e-6:
        return f"fits but communicates more ({c.comm_seconds:.3f} s/step vs {best.comm_seconds:.3f})"
    return f"fits with the same communication time; {best.strategy} is simpler"


def _precision(hw: Hardware) -> tuple[str, int, int, bool]:
    """(mixed_precision, param_bytes, grad_bytes, fp32 master weights)."""
    if hw.bf16:
        return "bf16", 2, 2, True
    if hw.fp16:
        return "fp16", 2, 2, True
    return "no", 4, 4, False


def _restrict(name: str, value, allowed: tuple) -> tuple:
    if value is None:
        return allowed
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(map(str, allowed))}")
    return (value,)


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
    safety_margin: float = 0.1,
    hardware: Hardware | None = None,
    pure_bf16: bool = False,
) -> Plan:
    """Plan distributed training of ``model`` (count, config, module, folder, config.json or hub name).

    ``strategy`` / ``offload`` / ``activation_checkpointing`` pin a choice instead of searching it.
    ``pure_bf16=True`` plans bf16 weights and bf16 Adam state without fp32 master weights (less memory,
    less accurate updates); by default mixed precision keeps fp32 masters. A module's loaded dtype is
    read (``Plan.model_dtype``); dtypes other than float32/bfloat16/float16 raise ValueError.
    Raises PlanError (a ValueError) naming the minimum hardware when nothing fits.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(METHODS)}")
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin!r}")
    for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    hw = hardware or detect_hardware(gpus=gpus, gpu_memory_gib=gpu_memory_gib, nodes=nodes)
    if method == "qlora" and hw.device != "cuda":
        raise ValueError("qlora needs CUDA GPUs (bitsandbytes 4-bit kernels); use method='lora' on CPU")
    if hw.device == "cpu" and offload not in (None, "none"):
        raise ValueError(f"offload {offload!r} moves states to host RAM, but training already runs on CPU; use 'none'")
    strategies = _restrict("strategy", strategy, STRATEGIES)
    # bitsandbytes 4-bit weights stay on the GPU, so QLoRA never offloads
    no_offload = (method == "qlora" or hw.device == "cpu") and offload is None
    offloads = _restrict("offload", offload, ("none",) if no_offload else OFFLOADS)
    ckpts = _restrict("activation_checkpointing", activation_checkpointing, (False, True))
    if strategy == "hsdp" and hw.nodes < 2:
        raise ValueError("strategy 'hsdp' needs nodes >= 2 (it replicates across nodes); use fsdp_full_shard")
    from hf_dist.precision import check_pure_bf16_hardware, loaded_dtype

    check_pure_bf16_hardware(pure_bf16, hw)
    model_dtype = loaded_dtype(model)
    spec = model_spec(model)
    mp, pb, gb, master = _precision(hw)
    master = master and not pure_bf16
    from hf_dist.memory import trainable_params

    setup = _Setup(
        spec, hw, method, optimizer, seq_len, lora_rank, pb, gb, master,
        usable=(1 - safety_margin) * hw.gpu_memory_gib * GIB,
        trainable=trainable_params(spec, method, lora_rank),
    )  # fmt: skip
    world = hw.world_size
    mbs = micro_batch_options(global_batch_size, micro_batch_size, world)
    combos = _combos(strategies, offloads, ckpts, hw.nodes)
    if not combos:
        raise ValueError(
            f"strategy {strategy!r} cannot use offload {offload!r}; allowed: {ALLOWED_OFFLOADS[strategy]}"
        )
    candidates = [_candidate(setup, s, o, c, mbs, global_batch_size) for s, o, c in combos]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise PlanError(_nothing_fits_message(setup, combos, candidates))
    best = min(fitting, key=_rank)
    for c in candidates:
        c.reason = _reason_for(c, best)
    global_batch = global_batch_size or best.micro_batch_size * world
    return Plan(
        strategy=best.strategy,
        offload=best.offload,
        activation_checkpointing=best.activation_checkpointing,
        micro_batch_size=best.micro_batch_size,
        gradient_accumulation_steps=global_batch // (best.micro_batch_size * world),
        global_batch_size=global_batch,
        num_params=spec.num_params,
        memory=best.memory,
        candidates=candidates,
        world_size=world,
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
        pure_bf16=pure_bf16,
        model_dtype=model_dtype,
    )


# ---------------------------------------------------------------- when nothing fits


def _nothing_fits_message(s: _Setup, combos, candidates: list[Candidate]) -> str:
    hw = s.hw
    # the GPU memory that would suffice is stated for plans without offload (offload also needs host RAM)
    smallest = min([c for c in candidates if c.offload == "none"] or candidates, key=lambda c: c.memory.total)
    margin = s.usable / (hw.gpu_memory_gib * GIB)
    msg = f"nothing fits on {hw.world_size} x {hw.gpu_memory_gib:.0f} GiB"
    if smallest.memory.total > s.usable:
        msg += (
            f": the smallest candidate ({smallest.strategy}, offload={smallest.offload}, activation_checkpointing="
            f"{smallest.activation_checkpointing}, micro_batch={smallest.micro_batch_size}) needs "
            f"{_fmt(smallest.memory.total)} per rank (usable {_fmt(s.usable)}); it would fit with "
            f"{smallest.memory.total / margin / GIB:.0f} GiB per GPU"
        )
    host = [c for c in candidates if c.reason.startswith("offloaded states")]
    if host:
        msg += f"; with CPU offload the {host[0].reason}"
    if _needs_tensor_parallel(s):
        return msg + (
            f". A single decoder layer ({s.spec.layer_params / 1e6:.0f}M params) with its gradients and activations "
            "does not fit on one GPU even with full sharding: tensor parallelism is needed (not covered by hf_dist)"
        )
    sharded = [(st, o, c) for st, o, c in combos if st in ("fsdp_full_shard", "zero3", "hsdp")] or combos
    found = _min_world(s, sharded)
    if found is None:
        return msg + "; no data-parallel world size up to 8192 GPUs fits: use tensor/pipeline parallelism"
    world, nodes, combo = found
    return msg + (
        f"; it would fit on at least {world} GPUs of {hw.gpu_memory_gib:.0f} GiB ({nodes} node(s)) with {combo[0]}, "
        f"offload={combo[1]}, activation_checkpointing={combo[2]}"
    )


def _needs_tensor_parallel(s: _Setup) -> bool:
    from hf_dist.memory import layer_activation_bytes

    if not s.spec.has_shape:
        return False
    trainable_layer = s.spec.layer_params if s.method == "full" else 0
    layer = s.spec.layer_params * s.pb + trainable_layer * s.gb
    acts = layer_activation_bytes(s.spec, s.seq_len, 1, s.pb)
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


def _fits_at(s: _Setup, combo: tuple[str, str, bool], size: tuple[int, int]) -> bool:
    (strategy, offload, ckpt), (world, nodes) = combo, size
    if strategy == "hsdp" and nodes < 2:
        return False
    return _estimate(s, strategy, offload, ckpt, 1, world=world, nodes=nodes).total <= s.usable
