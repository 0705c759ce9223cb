"""The tensor / context / sequence parallel sizes the planner may search, and why the others are left out.

Sizes are powers of two. TP stays inside a node (it all-reduces inside every layer) and needs a model whose
config carries a tensor-parallel plan; CP (torch ring attention through accelerate's ``ParallelismConfig``)
needs FSDP2 and CUDA; SP (DeepSpeed Ulysses) needs accelerate >= 1.12 and deepspeed >= 0.18.2. What the
installed libraries accept comes in as a ``LibraryFeatures`` (``hf_dist.planning.features.installed_features``);
a size the model cannot be split by (heads, KV heads, sequence length) is never offered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Sizes = tuple[int, int, int]  # tp, cp, sp


@dataclass(frozen=True)
class SizeOptions:
    """What may be searched per dimension, and a reason for each dimension that may not."""

    tp: tuple[int, ...] = ()
    cp: tuple[int, ...] = ()
    sp: tuple[int, ...] = ()
    unavailable: dict[str, str] = field(default_factory=dict)

    def triples(self, world_size: int) -> list[Sizes]:
        """Every (tp, cp, sp) other than (1, 1, 1) whose product divides the world (cp and sp never together)."""
        out = []
        for tp in (1, *self.tp):
            for cp, sp in [(1, 1)] + [(c, 1) for c in self.cp] + [(1, s) for s in self.sp]:
                if (tp, cp, sp) != (1, 1, 1) and world_size % (tp * cp * sp) == 0:
                    out.append((tp, cp, sp))
        return out

    def describe(self) -> str:
        parts = [
            f"{n} in {{{', '.join(map(str, v))}}}" for n, v in (("tp", self.tp), ("cp", self.cp), ("sp", self.sp)) if v
        ]
        return ", ".join(parts) or "nothing"


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 2
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _first_reason(*checks: tuple[bool, str]) -> str | None:
    """The reason of the first check that holds: why a dimension is unavailable, or None."""
    return next((reason for holds, reason in checks if holds), None)


def size_options(spec, hw, seq_len: int, features, *, method: str = "full") -> SizeOptions:
    """The sizes the model, the hardware, the installed libraries and the method allow, per dimension."""
    if not spec.has_shape:
        reason = "the model is a bare parameter count; pass a config to split it"
        return SizeOptions(unavailable={"tp": reason, "cp": reason, "sp": reason})
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    tp = [t for t in _powers_of_two(hw.gpus_per_node) if hw.gpus_per_node % t == 0 and heads % t == 0 and kv % t == 0]
    cp = [c for c in _powers_of_two(hw.world_size) if seq_len % (2 * c) == 0]
    sp = [s for s in _powers_of_two(hw.world_size) if heads % s == 0 and seq_len % s == 0]
    one_rank = "one GPU in the job: {} parallelism splits each sequence across ranks"
    # measured: PEFT's lora.Linear wraps a TP-sharded Linear and reshapes with the unsharded width
    # ("shape '[448, 16]' is invalid for input of size 14336"); DeepSpeed AutoTP replaces the wrapped layers
    lora_tp = (f"{method}: PEFT's LoRA layers do not run on tensor-parallel weights; shard the frozen base with "
               "fsdp_full_shard (or zero3) instead")  # fmt: skip
    reasons = {
        "tp": _first_reason(
            (method != "full", lora_tp),
            (not spec.tp_plan, "the model's config has no tensor-parallel plan (base_model_tp_plan)"),
            (not features.parallelism_config, "the installed accelerate/transformers lack ParallelismConfig (accelerate >= 1.10)"),
            (hw.gpus_per_node < 2, "one GPU per node: tensor parallelism splits layers across the GPUs of a node"),
            (not tp, f"no size > 1 divides the {hw.gpus_per_node} GPU(s) per node and the {kv} KV heads"),
        ),
        "cp": _first_reason(
            (hw.device != "cuda", "CPU ranks: torch's context_parallel has no CPU attention kernels"),
            (not (features.parallelism_config and features.fsdp_version == 2),
             "the installed accelerate/transformers lack FSDP2 with ParallelismConfig (accelerate >= 1.10)"),
            (hw.world_size < 2, one_rank.format("context")),
            (not cp, f"seq_len {seq_len} is not divisible by 4"),
        ),
        "sp": _first_reason(
            (not features.sequence_parallel, "needs accelerate >= 1.12 and deepspeed >= 0.18.2 (DeepSpeed Ulysses)"),
            (hw.world_size < 2, one_rank.format("sequence")),
            (not sp, f"no size > 1 divides the {heads} attention heads and seq_len {seq_len}"),
        ),
    }  # fmt: skip
    unavailable = {name: reason for name, reason in reasons.items() if reason}
    keep = {n: tuple(v) if n not in unavailable else () for n, v in (("tp", tp), ("cp", cp), ("sp", sp))}
    return SizeOptions(**keep, unavailable=unavailable)


# DeepSpeed's Ulysses data adapter keeps each rank's share of a batch as ``batch[k][:, start:end].cpu()``, a strided
# view on CPU ranks once the micro-batch is above 1, which transformers' loss cannot ``.view(-1)`` ("view size is
# not compatible"); on a GPU ``.cpu()`` copies it. Measured: docs/parallelism.md, "Ulysses SP ... micro-batch 1".
CPU_SP_MICRO_BATCH = 1


def micro_batch_limit(device: str, sp_size: int) -> tuple[int, str] | None:
    """``(largest micro-batch, why)`` for a layout that runs only micro-batches up to a size, else None."""
    if device == "cpu" and sp_size > 1:
        why = (
            f"Ulysses sequence parallelism (sp={sp_size}) runs on CPU ranks at micro-batch {CPU_SP_MICRO_BATCH} only "
            "(DeepSpeed's SP data adapter leaves each rank's labels a strided view there, which transformers' loss "
            "cannot .view(): docs/parallelism.md)"
        )
        return CPU_SP_MICRO_BATCH, why
    return None


def pinned_sizes(spec, options: SizeOptions, tp_size: int, cp_size: int, sp_size: int) -> Sizes:
    """Sizes the user asked for, refused here (before any model is built) when the model, the hardware or the
    installed libraries cannot run them (``options`` from :func:`size_options`)."""
    for name, size in (("tp", tp_size), ("cp", cp_size), ("sp", sp_size)):
        if size > 1 and name in options.unavailable:
            raise ValueError(f"{name}_size {size} cannot run here: {options.unavailable[name]}")
    return (tp_size, cp_size, sp_size)
