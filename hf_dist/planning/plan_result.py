"""What the planner returns: the :class:`Plan` (with ``explain()``), every :class:`Candidate` it weighed, and
the :class:`Combo` each was searched as. The search itself is :mod:`hf_dist.planning.planner`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from hf_dist.planning.dtypes import GIB
from hf_dist.planning.hardware import Hardware
from hf_dist.planning.layout import Layout, ReadsLayout
from hf_dist.planning.load_memory import LoadMemory
from hf_dist.planning.lora import LoraSpec
from hf_dist.planning.memory_estimate import MemoryEstimate
from hf_dist.planning.modelinfo import ModelSpec
from hf_dist.planning.throughput import StepTime


class Combo(NamedTuple):
    """One point of the search: a strategy with its offload, checkpointing, kernels and model-parallel sizes."""

    strategy: str
    offload: str
    ckpt: bool
    liger: bool
    tp: int = 1
    cp: int = 1
    sp: int = 1
    nvme: bool = False
    sync: bool = False  # FSDP2 reduce-scatters every micro-batch (sync_each_batch) instead of under no_sync

    @classmethod
    def of(cls, chosen: Any) -> Combo:
        """The point of a :class:`Candidate` or a :class:`Plan` (both carry the same fields)."""
        return cls(
            chosen.strategy, chosen.offload, chosen.activation_checkpointing, chosen.use_liger_kernel,
            chosen.tp_size, chosen.cp_size, chosen.sp_size, chosen.offload_device == "nvme", chosen.sync_each_batch,
        )  # fmt: skip

    def layout(self, hw: Hardware, world: int | None = None, nodes: int | None = None, **precision: Any) -> Layout:
        """This point on ``hw`` (or ``world`` ranks on ``nodes``); ``precision``: Layout's ``mixed_precision`` and
        ``pure_bf16``."""
        return Layout(
            self.strategy, world or hw.world_size, nodes or hw.nodes, self.offload, self.ckpt,
            tp_size=self.tp, cp_size=self.cp, sp_size=self.sp, offload_device="nvme" if self.nvme else "cpu",
            sync_each_batch=self.sync, **precision,
        )  # fmt: skip


def _duration(seconds: float, gpu_hours: float) -> str:
    """``~12.3 h (98 GPU-hours)``, in minutes under an hour and days over three."""
    if seconds < 3600:
        wall = f"~{seconds / 60:.0f} min"
    elif seconds < 3 * 86400:
        wall = f"~{seconds / 3600:.1f} h"
    else:
        wall = f"~{seconds / 86400:.1f} days"
    return f"{wall} ({gpu_hours:,.0f} GPU-hours)"


def format_bytes(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if abs(num_bytes) >= GIB else f"{num_bytes / 1024**2:.1f} MiB"


# What a candidate's and a plan's JSON say of their layout, flat, as they read them (the point; the plan's layout)
POINT_FIELDS = ("strategy", "offload", "activation_checkpointing", "tp_size", "cp_size", "sp_size", "offload_device",
                "sync_each_batch")  # fmt: skip
LAYOUT_FIELDS = (*POINT_FIELDS, "world_size", "nodes", "mixed_precision", "pure_bf16")


class PlanError(ValueError):
    """Nothing fits; the message names the minimum hardware that would."""


@dataclass
class Candidate:
    """One point of the search (:class:`Combo`, whose :meth:`Combo.layout` is its layout) with what it was found to
    need and give: its largest fitting micro-batch, memory, speed, and why it was chosen or not."""

    key: Combo
    micro_batch_size: int
    memory: MemoryEstimate
    fits: bool
    reason: str
    comm_seconds: float | None
    time: StepTime | None = None

    # The point's fields, as the plan's tables and JSON name them
    strategy = property(lambda self: self.key.strategy)
    offload = property(lambda self: self.key.offload)
    activation_checkpointing = property(lambda self: self.key.ckpt)
    use_liger_kernel = property(lambda self: self.key.liger)
    tp_size = property(lambda self: self.key.tp)
    cp_size = property(lambda self: self.key.cp)
    sp_size = property(lambda self: self.key.sp)
    offload_device = property(lambda self: "nvme" if self.key.nvme else "cpu")
    sync_each_batch = property(lambda self: self.key.sync)

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.time is None else self.time.tokens_per_s

    def to_dict(self) -> dict:
        found = {"micro_batch_size": self.micro_batch_size, "fits": self.fits, "reason": self.reason,
                 "comm_seconds": self.comm_seconds}  # fmt: skip
        point = {name: getattr(self, name) for name in (*POINT_FIELDS, "use_liger_kernel")}
        return {**point, **found, "memory": self.memory.to_dict(), "tokens_per_s": self.tokens_per_s}

    @property
    def model_parallel(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    @property
    def label(self) -> str:
        """``fsdp_full_shard/none+ckpt tp=2``: the candidate in one token for the reasons list."""
        flags = ("+ckpt" if self.activation_checkpointing else "") + ("+liger" if self.use_liger_kernel else "")
        flags += "+sync" if self.sync_each_batch else ""
        where = "@nvme" if self.offload_device == "nvme" else ""
        sizes = "".join(
            f" {n}={v}" for n, v in (("tp", self.tp_size), ("cp", self.cp_size), ("sp", self.sp_size)) if v > 1
        )
        return f"{self.strategy}/{self.offload}{where}{flags}{sizes}"


@dataclass
class Plan(ReadsLayout):
    layout: Layout  # the chosen layout: strategy, sizes, offload (and its device), checkpointing, precision
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    num_params: int
    memory: MemoryEstimate
    candidates: list[Candidate]
    method: str
    seq_len: int
    hardware: Hardware
    model: ModelSpec
    optimizer: str
    lora: LoraSpec | None = None  # the LoRA planned (method lora/qlora): hf_dist.planning.lora
    reason: str = ""
    usable_gib: float = field(default=0.0)
    use_liger_kernel: bool = False
    tokens_per_s: float | None = None  # estimated, all ranks
    liger_note: str = ""  # what Liger kernels would gain when they are not available
    margin_note: str = ""  # a faster layout that misses the usable memory by under 1 % of the card, and its margin
    offload_note: str = ""  # a LoRA plan that offloads: what QLoRA or Liger would fit without offload
    model_dtype: str | None = None  # dtype the given module was loaded in; None for a name/config/count
    dimensions: list[str] = field(default_factory=list)  # why each model-parallel dimension was or was not used
    trace: Any = None  # hf_dist.tracing.TraceResult of the chosen layout, with plan(verify=True)
    verification: str = ""  # what plan(verify=True) traced, rejected, or could not trace, and why
    load: LoadMemory | None = None  # host RAM while the chosen engine loads the model
    staging_bytes: int | None = None  # host RAM per node of async_save's staging copy (None: not planned)
    fused_lm_head: bool = False  # the loss runs through TRL's fused LM head (SFTTrainer): no logits held
    train_tokens: int | None = None  # tokens the run trains on: time_to_finish() and explain() state the wall time
    trainable_params: int = 0  # what sum(p.numel() for p in model.parameters() if p.requires_grad) will count
    wrap_classes: list[str] | None = None  # FSDP wrap classes auto_args emitted (a user's wrap_classes= included)

    @property
    def lora_rank(self) -> int | None:
        return None if self.lora is None else self.lora.rank

    @property
    def swap_bytes(self) -> int:
        """Bytes per node of ZeRO-Infinity's swap files under ``nvme_path`` (0 unless ``offload_device="nvme"``):
        what the NVMe drive of each node must hold free (:mod:`hf_dist.planning.nvme`)."""
        return self.memory.swap * self.hardware.gpus_per_node if self.offload_device == "nvme" else 0

    def time_to_finish(self, candidate: Candidate | None = None) -> tuple[float, float] | None:
        """(wall seconds, GPU-hours) to train ``train_tokens`` at the estimated speed of the chosen layout, or of one
        of its ``candidate`` alternatives; None without ``train_tokens`` or a speed estimate."""
        speed = (candidate or self).tokens_per_s
        if not self.train_tokens or not speed:
            return None
        seconds = self.train_tokens / speed
        return seconds, seconds * self.world_size / 3600

    def _time_text(self) -> str:
        """The chosen layout's time to finish, then the fastest fitting alternatives'."""
        chosen = self.time_to_finish()
        if chosen is None:
            return ""
        others = sorted(
            (c for c in self.candidates if c.fits and c.key != self._chosen_key and c.tokens_per_s),
            key=lambda c: -(c.tokens_per_s or 0),
        )[:3]
        alternatives = "; ".join(f"{c.label} {_duration(*self.time_to_finish(c))}" for c in others)
        return (
            f"{self.train_tokens:.3g} tokens in {_duration(*chosen)} on {self.world_size} GPUs"
            + (f" (alternatives: {alternatives})" if alternatives else "")
            + "; estimated from the modelled speed, which the throughput callback corrects as it runs (perf/eta_s)"
        )

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
        skip = ("layout", "memory", "candidates", "hardware", "model", "trace", "load", "lora")
        out = {name: getattr(self, name) for name in LAYOUT_FIELDS}
        out.update((k, v) for k, v in asdict(self).items() if k not in skip)
        out["lora"] = self.lora.to_dict() if self.lora is not None else None
        out["trace"] = self.trace.to_dict() if self.trace is not None else None
        out["memory"] = self.memory.to_dict()
        out["optimizer_state_dtype"] = self.optimizer_state_dtype
        out["swap_bytes"] = self.swap_bytes
        out["hardware"] = self.hardware.to_dict()
        finish = self.time_to_finish()
        out["time_to_finish"] = None if finish is None else {"seconds": finish[0], "gpu_hours": finish[1]}
        out["load"] = None if self.load is None else {**asdict(self.load), "path": self.load.path.name}
        out["model"] = {k: v for k, v in asdict(self.model).items() if k != "config"}
        out["candidates"] = [c.to_dict() for c in self.candidates]
        json.dumps(out)  # fail here, not in the caller, if something is not serializable
        return out

    def explain(self) -> str:
        """A readable table of every candidate by component (per rank) with its verdict and reason."""
        lines = [*self._header_lines(), *self._note_lines(), *self._table_lines()]
        if self.verification:
            lines.append(f"verify: {self.verification}")
        if self.trace is not None:
            lines.append(self.trace.compare(self.memory))
        lines += ["", "reasons:", *(f"  {c.label}: {c.reason}" for c in self.candidates)]
        return "\n".join(lines)

    def _header_lines(self) -> list[str]:
        """The model, the hardware, the choice and why."""
        hw = self.hardware
        size = f"{self.num_params / 1e9:.2f}B" if self.num_params >= 1e9 else f"{self.num_params / 1e6:.2f}M"
        speed = f", ~{self.tokens_per_s:,.0f} tokens/s estimated" if self.tokens_per_s else ""
        return [
            f"model: {self.model.name or 'model'} ({size} params), method={self.method}, optimizer={self.optimizer}, "
            f"seq_len={self.seq_len}, precision={self._precision_text()}"
            + (f", model loaded in {self.model_dtype}" if self.model_dtype else "")
            + (", loss through TRL's fused LM head" if self.fused_lm_head else ""),
            f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} {hw.gpu_name or hw.device} "
            f"({hw.gpu_memory_gib:.1f} GiB, usable {self.usable_gib:.1f} GiB after safety margin)",
            f"chosen: {self.strategy}{self._sizes_text()}, offload={self.offload}"
            f"{' to NVMe' if self.offload_device == 'nvme' else ''}, activation_checkpointing="
            f"{self.activation_checkpointing}, use_liger_kernel={self.use_liger_kernel}, "
            + ("sync_each_batch=True, " if self.sync_each_batch else "")
            + f"micro_batch={self.micro_batch_size} x accumulation={self.gradient_accumulation_steps} x data_parallel="
            f"{self.layout.dp_size} = global_batch {self.global_batch_size}{speed}",
            f"why: {self.reason}",
        ] + ([f"lora: {self.lora.describe()}: {self.trainable_params:,} trainable parameters"] if self.lora else [])

    def _note_lines(self) -> list[str]:
        """Host RAM, swap files, staging, time, and the planner's notes, each where it applies."""
        lines = []
        if self.load is not None:
            lines.append(f"host RAM at load: {self.load.text()}")
        if self.swap_bytes:
            lines.append(
                f"NVMe swap files: {format_bytes(self.swap_bytes)} per node under nvme_path "
                f"({format_bytes(self.memory.swap)} per GPU); host RAM still pinned: {format_bytes(self.memory.cpu)} per GPU"
            )
        if self.staging_bytes is not None:
            staging = f"{format_bytes(self.staging_bytes)} per node" if self.staging_bytes else (
                "none: DeepSpeed writes its checkpoint itself, synchronously")  # fmt: skip
            lines.append(f"host RAM for async_save's staging copy: {staging}")
        notes = (("time to finish", self._time_text()), ("liger", self.liger_note), ("margin", self.margin_note),
                 ("instead of offload", self.offload_note))  # fmt: skip
        lines += [f"{label}: {note}" for label, note in notes if note]
        return lines + [f"parallelism: {note}" for note in self.dimensions]

    def _table_lines(self) -> list[str]:
        """Every candidate's memory by component, speed and verdict, in MiB for small models."""
        unit, div = ("GiB", GIB) if max(c.memory.total for c in self.candidates) >= GIB else ("MiB", 1024**2)
        terms = ("params", "grads", "optimizer", "activations", "logits", "buffers", "allocator", "overhead", "total")
        sized = any(c.model_parallel > 1 or c.offload_device == "nvme" for c in self.candidates)
        synced = any(c.sync_each_batch for c in self.candidates)
        header = ("strategy", "offload", "ckpt", "liger") + (("sync",) if synced else ())
        header += (("tp/cp/sp",) if sized else ()) + ("mb", "params")
        header += ("grads", "optim", "acts", "logits", "buffers", "allocator", "overhead", "total", "tok/s", "verdict")
        rows = [header]
        for c in self.candidates:
            verdict = "CHOSEN" if c.key == self._chosen_key else ("fits" if c.fits else "no fit")
            sizes = [f"{getattr(c.memory, t) / div:.2f}" for t in terms]
            speed = "-" if c.tokens_per_s is None else f"{c.tokens_per_s:,.0f}"
            flags = ("yes" if c.activation_checkpointing else "no", "yes" if c.use_liger_kernel else "no")
            flags += ("yes" if c.sync_each_batch else "no",) if synced else ()
            offload = c.offload + ("@nvme" if c.offload_device == "nvme" else "")
            dims = (f"{c.tp_size}/{c.cp_size}/{c.sp_size}",) if sized else ()
            rows.append((c.strategy, offload, *flags, *dims, str(c.micro_batch_size), *sizes, speed, verdict))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        first_number = 4 + sized + synced
        lines = [
            f"per-rank memory in {unit} (total = device memory in use at the peak: allocated tensors + caching "
            "allocator + CUDA context):"
        ]
        for row in rows:
            cells = [
                cell.rjust(w) if i >= first_number else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ]
            lines.append("  ".join(cells))
        return lines

    def _sizes_text(self) -> str:
        sizes = [f"{n}={getattr(self, n + '_size')}" for n in ("tp", "cp", "sp") if getattr(self, n + "_size") > 1]
        return (" " + " ".join(sizes)) if sizes else ""

    @property
    def _chosen_key(self) -> Combo:
        return Combo.of(self)
