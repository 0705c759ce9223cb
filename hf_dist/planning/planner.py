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
Each (strategy, offload, checkpointing, Liger) uses the micro-batch that fits with the highest
estimated tokens/s; gradient accumulation keeps the global batch: global = micro * accumulation * world.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hf_dist.planning.hardware import Hardware, detect_hardware
from hf_dist.planning.layout import OFFLOADS, REGISTRY, STRATEGIES, Layout
from hf_dist.planning.memory import GIB, METHODS, MemoryEstimate, estimate_memory
from hf_dist.planning.modelinfo import ModelSpec, model_spec
from hf_dist.planning.throughput import StepTime, comm_seconds, step_time
from hf_dist.validation import restrict

__all__ = ["Plan", "PlanError", "Candidate", "plan", "comm_seconds", "micro_batch_options"]

MAX_MICRO_BATCH = 16
# estimates closer than this are ties, which go to the simpler layout (the throughput model is not
# more precise than that)
TIE_FRACTION = 0.03


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
    use_liger_kernel: bool = False
    time: StepTime | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.time is None else self.time.tokens_per_s

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        return (self.strategy, self.offload, self.activation_checkpointing, self.use_liger_kernel)


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
    use_liger_kernel: bool = False
    tokens_per_s: float | None = None  # estimated, all ranks
    liger_note: str = ""  # what Liger kernels would gain when they are not available
    pure_bf16: bool = False  # bf16 weights and Adam state, no fp32 master weights (only when asked for)
    model_dtype: str | None = None  # dtype the given module was loaded in; None for a name/config/count

    @property
    def layout(self) -> Layout:
        """The chosen layout as one typed object (strategy, sizes, offload, checkpointing, precision)."""
        return Layout(
            self.strategy, self.world_size, self.nodes, self.offload, self.activation_checkpointing,
            self.mixed_precision, self.pure_bf16,
        )  # fmt: skip

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
            {
                **{k: v for k, v in asdict(c).items() if k not in ("memory", "time")},
                "memory": c.memory.to_dict(),
                "tokens_per_s": c.tokens_per_s,
            }
            for c in self.candidates
        ]
        json.dumps(out)  # fail here, not in the caller, if something is not serializable
        return out

    def explain(self) -> str:
        """A readable table of every candidate by component (per rank) with its verdict and reason."""
        hw = self.hardware
        size = f"{self.num_params / 1e9:.2f}B" if self.num_params >= 1e9 else f"{self.num_params / 1e6:.2f}M"
        # small models read better in MiB
        unit, div = ("GiB", GIB) if max(c.memory.total for c in self.candidates) >= GIB else ("MiB", 1024**2)
        speed = f", ~{self.tokens_per_s:,.0f} tokens/s estimated" if self.tokens_per_s else ""
        lines = [
            f"model: {self.model.name or 'model'} ({size} params), method={self.method}, optimizer={self.optimizer}, "
            f"seq_len={self.seq_len}, precision={self._precision_text()}"
            + (f", model loaded in {self.model_dtype}" if self.model_dtype else ""),
            f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} {hw.gpu_name or hw.device} "
            f"({hw.gpu_memory_gib:.1f} GiB, usable {self.usable_gib:.1f} GiB after safety margin)",
            f"chosen: {self.strategy}, offload={self.offload}, activation_checkpointing={self.activation_checkpointing}, "
            f"use_liger_kernel={self.use_liger_kernel}, micro_batch={self.micro_batch_size} x accumulation="
            f"{self.gradient_accumulation_steps} x world={self.world_size} = global_batch {self.global_batch_size}{speed}",
            f"why: {self.reason}",
        ]
        if self.liger_note:
            lines.append(f"liger: {self.liger_note}")
        lines.append(
            f"per-rank memory in {unit} (total = device memory in use at the peak: allocated tensors + caching "
            "allocator + CUDA context):"
        )
        terms = ("params", "grads", "optimizer", "activations", "logits", "buffers", "allocator", "overhead", "total")
        header = ("strategy", "offload", "ckpt", "liger", "mb", "params", "grads", "optim", "acts", "logits")
        header += ("buffers", "allocator", "overhead", "total", "tok/s", "verdict")
        rows = [header]
        for c in self.candidates:
            verdict = "CHOSEN" if c.key == self._chosen_key else ("fits" if c.fits else "no fit")
            sizes = [f"{getattr(c.memory, t) / div:.2f}" for t in terms]
            speed = "-" if c.tokens_per_s is None else f"{c.tokens_per_s:,.0f}"
            flags = ("yes" if c.activation_checkpointing else "no", "yes" if c.use_liger_kernel else "no")
            rows.append((c.strategy, c.offload, *flags, str(c.micro_batch_size), *sizes, speed, verdict))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for row in rows:
            cells = [
                cell.rjust(w) if i >= 4 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells))
        lines.append("")
        lines.append("reasons:")
        for c in self.candidates:
            flags = ("+ckpt" if c.activation_checkpointing else "") + ("+liger" if c.use_liger_kernel else "")
            lines.append(f"  {c.strategy}/{c.offload}{flags}: {c.reason}")
        return "\n".join(lines)

    @property
    def _chosen_key(self) -> tuple[str, str, bool, bool]:
        return (self.strategy, self.offload, self.activation_checkpointing, self.use_liger_kernel)


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


Combo = tuple[str, str, bool, bool]  # strategy, offload, activation checkpointing, Liger kernels


def _estimate(s: _Setup, combo: Combo, mb, world=None, nodes=None, accum=1) -> MemoryEstimate:
    strategy, offload, ckpt, liger = combo
    return estimate_memory(
        s.spec,
        strategy,
        world or s.hw.world_size,
        nodes=nodes or s.hw.nodes,
        method=s.method,
        offload=offload,
        optimizer=s.optimizer,
        master_weights=s.master,
        base_bytes=s.base_bytes,
        param_bytes=s.pb,
        seq_len=s.seq_len,
        micro_batch_size=mb,
        activation_checkpointing=ckpt,
        lora_rank=s.lora_rank,
        gradient_accumulation_steps=accum,
        use_liger_kernel=liger,
        device=s.hw.device,
    )


def _time(s: _Setup, combo: Combo, mb: int, accum: int, memory: MemoryEstimate) -> StepTime:
    strategy, offload, ckpt, liger = combo
    hw = s.hw
    grad_bytes = 4 if s.pb == 4 else 2  # what the collectives move (DeepSpeed reduces in the compute dtype)
    comm = comm_seconds(
        REGISTRY[strategy], offload, s.spec, s.trainable, hw.world_size, hw.nodes, accum, s.pb, grad_bytes, hw
    )
    return step_time(
        s.spec, hw, memory, strategy=REGISTRY[strategy], offload=offload, trainable=s.trainable, micro_batch_size=mb,
        accumulation=accum, seq_len=s.seq_len, activation_checkpointing=ckpt, use_liger_kernel=liger, comm=comm,
    )  # fmt: skip


def _combos(strategies, offloads, ckpts, ligers, hw: Hardware, pinned: bool) -> list[Combo]:
    """Every allowed combination. On one GPU there is nothing to shard: a sharding engine is only
    searched with offload (it would add its overhead for nothing), unless the strategy is pinned."""
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
                    if offload in s.offloads:
                        out.append((name, offload, ckpt, liger))
    return out


def _candidate(s: _Setup, combo: Combo, mbs, global_batch) -> Candidate:
    world = s.hw.world_size
    host_need = _estimate(s, combo, mbs[-1]).cpu * s.hw.gpus_per_node
    host_usable = s.usable / (s.hw.gpu_memory_gib * GIB) * s.hw.host_memory_limit_gib * GIB
    strategy, offload, ckpt, liger = combo
    if host_need > host_usable:
        mem = _estimate(s, combo, mbs[-1])
        reason = (
            f"offloaded states need {_fmt(host_need)} of host RAM per node, more than the usable {_fmt(host_usable)} "
            "(pass --host-memory / detect_hardware(host_memory_gib=...) if it is larger)"
        )
        return Candidate(strategy, offload, ckpt, mbs[-1], mem, False, reason, None, liger)
    best = None
    for mb in mbs:  # largest first; memory only grows with the micro-batch
        accum = (global_batch // (mb * world)) if global_batch else 1
        mem = _estimate(s, combo, mb, accum=accum)
        if mem.total > s.usable:
            continue
        time = _time(s, combo, mb, accum, mem)
        if best is None or time.tokens_per_s > best.time.tokens_per_s * (1 + TIE_FRACTION):
            best = Candidate(strategy, offload, ckpt, mb, mem, True, "", time.comm, liger, time)
    if best is not None:
        return best
    short = mem.total - s.usable
    reason = f"needs {_fmt(mem.total)} per rank at micro_batch {mbs[-1]}, {_fmt(short)} over the usable memory"
    return Candidate(strategy, offload, ckpt, mbs[-1], mem, False, reason, None, liger)


def _best(fitting: list[Candidate]) -> Candidate:
    """Least offload, then the fastest; estimates within TIE_FRACTION of it go to the simpler layout."""
    level = min(OFFLOADS.index(c.offload) for c in fitting)
    pool = [c for c in fitting if OFFLOADS.index(c.offload) == level]
    fastest = max(c.tokens_per_s for c in pool)
    close = [c for c in pool if c.tokens_per_s >= fastest * (1 - TIE_FRACTION)]
    return min(close, key=lambda c: (c.activation_checkpointing, REGISTRY[c.strategy].preference, -c.tokens_per_s))


def _reason_for(c: Candidate, best: Candidate) -> str:
    if c is best:
        notes = []
        if REGISTRY[c.strategy].is_deepspeed and c.offload == "optimizer":
            notes.append("DeepSpeed because FSDP2 cannot offload only the optimizer")
        if c.offload != "none":
            notes.append(f"offload={c.offload} because nothing fits without it")
        if c.activation_checkpointing:
            notes.append("activation checkpointing: its recompute costs less than the smaller micro-batch without it")
        if c.use_liger_kernel:
            notes.append("Liger kernels: fused RMSNorm/SwiGLU/RoPE/linear cross-entropy save memory and time")
        t = c.time
        extra = ("; " + "; ".join(notes)) if notes else ""
        return (
            f"fits ({_fmt(c.memory.total)}) with the highest estimated throughput (~{t.tokens_per_s:,.0f} tokens/s: "
            f"{t.seconds:.3f} s/step, {t.comm:.3f} s communication){extra}"
        )
    if not c.fits:
        return c.reason
    if c.offload != best.offload:
        return f"fits but uses CPU offload ({c.offload}), which the chosen plan avoids"
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
    return f"fits at about the same speed; {best.strategy} is simpler"


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
) -> Plan:
    """Plan distributed training of ``model`` (count, config, module, folder, config.json or hub name).

    ``strategy`` / ``offload`` / ``activation_checkpointing`` / ``use_liger_kernel`` pin a choice
    instead of searching it (Liger kernels are searched on CUDA when liger-kernel is installed).
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
    strategies = restrict("strategy", strategy, STRATEGIES)
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

    setup = _Setup(
        spec, hw, method, optimizer, seq_len, lora_rank, pb, master, 4 if model_dtype == "float32" else pb,
        usable=(1 - safety_margin) * hw.gpu_memory_gib * GIB,
        trainable=trainable_params(spec, method, lora_rank),
    )  # fmt: skip
    world = hw.world_size
    mbs = micro_batch_options(global_batch_size, micro_batch_size, world)
    combos = _combos(strategies, offloads, ckpts, ligers, hw, pinned=strategy is not None)
    if not combos:
        raise ValueError(
            f"strategy {strategy!r} cannot use offload {offload!r}; allowed: {REGISTRY[strategy].offloads}"
        )
    candidates = [_candidate(setup, combo, mbs, global_batch_size) for combo in combos]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise PlanError(_nothing_fits_message(setup, combos, candidates))
    best = _best(fitting)
    for c in candidates:
        c.reason = _reason_for(c, best)
    global_batch = global_batch_size or best.micro_batch_size * world
    note = ""
    if use_liger_kernel is None and hw.device == "cuda" and not hw.liger_kernel and spec.has_shape:
        note = _liger_gain(setup, best, mbs, global_batch_size)
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
        use_liger_kernel=best.use_liger_kernel,
        tokens_per_s=best.tokens_per_s,
        liger_note=note,
        pure_bf16=pure_bf16,
        model_dtype=model_dtype,
    )


def _liger_gain(s: _Setup, best: Candidate, mbs, global_batch) -> str:
    """What Liger kernels would change for the chosen layout, when the package is missing."""
    strategy, offload, _, _ = best.key
    options = [_candidate(s, (strategy, offload, ckpt, True), mbs, global_batch) for ckpt in (False, True)]
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
        f"{_fmt(alt.memory.total)} and run ~{gain:.0%} faster (~{alt.tokens_per_s:,.0f} tokens/s)"
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
    fully_sharded = [c for c in combos if REGISTRY[c[0]].shards.params and not REGISTRY[c[0]].gathers_params]
    sharded = fully_sharded or combos
    found = _min_world(s, sharded)
    if found is None:
        return msg + "; no data-parallel world size up to 8192 GPUs fits: use tensor/pipeline parallelism"
    world, nodes, combo = found
    return msg + (
        f"; it would fit on at least {world} GPUs of {hw.gpu_memory_gib:.0f} GiB ({nodes} node(s)) with {combo[0]}, "
        f"offload={combo[1]}, activation_checkpointing={combo[2]}"
    )


def _needs_tensor_parallel(s: _Setup) -> bool:
    from hf_dist.planning.memory import layer_activation_bytes

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
