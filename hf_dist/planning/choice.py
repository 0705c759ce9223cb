"""The choice among the candidates that fit, and the reason given for every candidate (rules in
:mod:`hf_dist.planning.planner`)."""

from __future__ import annotations

from hf_dist.planning.layout import OFFLOADS, REGISTRY
from hf_dist.planning.plan_result import Candidate, format_bytes

# estimates closer than this are ties, which go to the simpler layout (the throughput model is not
# more precise than that)
TIE_FRACTION = 0.03


def offload_level(c: Candidate) -> int:
    """The ladder's order of last resorts: no offload, CPU offload (optimizer, then parameters), then NVMe."""
    return OFFLOADS.index(c.offload) + (len(OFFLOADS) if c.offload_device == "nvme" else 0)


def best(fitting: list[Candidate]) -> Candidate:
    """Least offload, then the fastest; estimates within TIE_FRACTION of it go to the simpler layout (no
    checkpointing, fewer model-parallel ranks, the registry's preference)."""
    level = min(offload_level(c) for c in fitting)
    pool = [c for c in fitting if offload_level(c) == level]
    fastest = max(c.tokens_per_s for c in pool)
    close = [c for c in pool if c.tokens_per_s >= fastest * (1 - TIE_FRACTION)]
    return min(
        close,
        key=lambda c: (
            c.activation_checkpointing, c.sync_each_batch, c.model_parallel, REGISTRY[c.strategy].preference,
            -c.tokens_per_s,
        ),
    )  # fmt: skip


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
    return f"fits at about the same speed; {best.label} is simpler"
