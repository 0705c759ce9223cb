"""The choice among the candidates that fit, and the reason given for every candidate (rules in
:mod:`hf_dist.planning.planner`)."""

from __future__ import annotations

from hf_dist.planning.layout import OFFLOADS, REGISTRY
from hf_dist.planning.plan_result import Candidate, format_bytes

# estimates closer than this are ties, which go to the simpler layout (no checkpointing, no per-micro-batch sync, ...)
TIE_FRACTION = 0.03
# A layout with more sharding or parallelism must be estimated faster than a simpler one that fits by more than this to
# be picked over it: the throughput model's own error on the GPU ground truth (measured / estimated 0.88-1.15 over the
# H100 and H200 runs, docs/measurements.md), inside which an estimated edge is no evidence (one H100, world size 1:
# FSDP2 full shard ran 1.15-1.4x slower than DDP at the same micro-batch).
LAYOUT_ERROR = 0.15


def offload_level(c: Candidate) -> int:
    """The ladder's order of last resorts: no offload, CPU offload (optimizer, then parameters), then NVMe."""
    return OFFLOADS.index(c.offload) + (len(OFFLOADS) if c.offload_device == "nvme" else 0)


def best(fitting: list[Candidate]) -> Candidate:
    """Least offload, then the fastest; estimates within TIE_FRACTION of it go to the simpler layout (no
    checkpointing, fewer model-parallel ranks, the registry's preference). Then the least sharded layout
    (:func:`sharding`) whose estimate is within LAYOUT_ERROR of that choice's, and that adds no checkpointing or
    per-micro-batch sync, replaces it."""
    level = min(offload_level(c) for c in fitting)
    pool = [c for c in fitting if offload_level(c) == level]
    fastest = max(c.tokens_per_s for c in pool)
    close = [c for c in pool if c.tokens_per_s >= fastest * (1 - TIE_FRACTION)]
    chosen = min(
        close,
        key=lambda c: (
            c.activation_checkpointing, c.sync_each_batch, c.model_parallel, REGISTRY[c.strategy].preference,
            -c.tokens_per_s,
        ),
    )  # fmt: skip
    within = [
        c for c in pool if c.tokens_per_s * (1 + LAYOUT_ERROR) >= chosen.tokens_per_s
        and c.activation_checkpointing <= chosen.activation_checkpointing and c.sync_each_batch <= chosen.sync_each_batch
    ]  # fmt: skip
    simplest = min(within, key=lambda c: (sharding(c), -c.tokens_per_s))
    return simplest if sharding(simplest) < sharding(chosen) else chosen


def sharding(c: Candidate) -> tuple[int, int]:
    """How much a layout splits the model: its model-parallel ranks, then the registry's preference (DDP first)."""
    return c.model_parallel, REGISTRY[c.strategy].preference


def error_tie(c: Candidate, candidates) -> Candidate | None:
    """The faster layout with more sharding or parallelism that ``c`` was picked over because its estimated gain is
    within LAYOUT_ERROR (None when ``c`` is the fastest at its offload level)."""
    rivals = [o for o in candidates if o.fits and offload_level(o) == offload_level(c) and sharding(o) > sharding(c)]
    faster = [o for o in rivals if o.tokens_per_s > c.tokens_per_s * (1 + TIE_FRACTION)]
    return max(faster, key=lambda o: o.tokens_per_s) if faster else None


def sync_note(c: Candidate, candidates) -> str:
    """Why the chosen FSDP2 layout reduce-scatters every micro-batch: what the Trainer's ``no_sync`` would hold (its
    unsharded gradients until the last micro-batch), and what the same layout reached without it."""
    unsynced = next((o for o in candidates if o.key == c.key._replace(sync=False)), None)
    held = f"{format_bytes(unsynced.memory.grads)} of unsharded gradients" if unsynced else "every unsharded gradient"
    without = ""
    if unsynced is not None:
        without = (f" (without it: micro_batch {unsynced.micro_batch_size}, ~{unsynced.tokens_per_s:,.0f} tokens/s)"
                   if unsynced.fits else f" (without it: {unsynced.reason})")  # fmt: skip
    return (
        f"sync_each_batch: FSDP2 reduce-scatters every micro-batch ({c.time.comm:.3f} s/step communication) and holds "
        f"{format_bytes(c.memory.grads)} of sharded gradients between micro-batches instead of the Trainer's no_sync "
        f"keeping {held} until the last, so micro_batch {c.micro_batch_size} fits{without}"
    )


def reason_for(c: Candidate, best: Candidate, pinned: bool = False, offload_pinned: bool = False,
               candidates=(), split_reason: str = "no data-parallel layout fits without offload") -> str:  # fmt: skip
    """Why ``c`` was chosen or not; ``split_reason``: why model parallelism was searched
    (:attr:`hf_dist.planning.search.Search.split_reason`)."""
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
            notes.append(f"{c.label.split(' ', 1)[1]} because {split_reason}")
        elif c.model_parallel > 1:
            notes.append(f"{c.label.split(' ', 1)[1]} as asked")
        if c.activation_checkpointing:
            notes.append("activation checkpointing: its recompute costs less than the smaller micro-batch without it")
        if c.use_liger_kernel:
            notes.append("Liger kernels: fused RMSNorm/SwiGLU/RoPE/linear cross-entropy save memory and time")
        if c.sync_each_batch:
            notes.append(sync_note(c, candidates))
        if (rival := error_tie(c, candidates)) is not None:
            gain = rival.tokens_per_s / c.tokens_per_s - 1
            notes.append(f"simpler than {rival.label}, whose estimated {gain:.0%} edge is within the throughput "
                         f"model's measured error ({LAYOUT_ERROR:.0%})")  # fmt: skip
        t = c.time
        extra = ("; " + "; ".join(notes)) if notes else ""
        return (
            f"fits ({format_bytes(c.memory.total)}) with the highest estimated throughput (~{t.tokens_per_s:,.0f} tokens/s: "
            f"{t.seconds:.3f} s/step, {t.comm:.3f} s communication){extra}"
        )
    if not c.fits:
        return c.reason
    if offload_level(c) != offload_level(best):
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
    if c.tokens_per_s > best.tokens_per_s * (1 + TIE_FRACTION):
        gain = c.tokens_per_s / best.tokens_per_s - 1
        return (f"fits and is estimated {gain:.0%} faster, within the throughput model's measured error "
                f"({LAYOUT_ERROR:.0%}); {best.label} shards less")  # fmt: skip
    return f"fits at about the same speed; {best.label} is simpler"
