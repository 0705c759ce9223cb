"""Replicas agree: every rank starts from the same trainable parameters.

A model built on each rank without a seed (a LoRA adapter from ``get_peft_model``, a model ``from_config``) holds
different random values on each rank. DDP and DeepSpeed broadcast rank 0's parameters when they wrap the model, so
every rank trains rank 0's copy. FSDP2 does only with ``cpu_ram_efficient_loading`` (rank 0's full state dict
broadcast); without it ``fully_shard`` keeps each rank's slice of its own copy, and the run trains a mix of the ranks'
adapters (issue 39: step-1 gradient norm 0.375 under FSDP2, 0.313 under DDP).

The mix arises when the model is sharded, so it must be seen before: once sharded, ``DTensor.full_tensor()`` gathers
the same mix on every rank. :func:`check_replicas_agree` (called by :func:`hf_dist.callbacks.attach`, before the
Trainer prepares the model) compares a float64 sum per trainable parameter across all ranks, one gather of small
objects. Parameters already sharded (DTensors of a model sharded at load, ZeRO-3 partitions) are skipped: their local
shards differ by design and their engine built them from one source.
"""

from __future__ import annotations

from typing import Any

from hf_dist.runtime import dist as _dist

FIX = "seed before creating the model and adapter (transformers.set_seed(SEED) before get_peft_model / from_config)"


class ReplicaMismatchError(RuntimeError):
    """The ranks' trainable parameters differ and the engine would train a mix of them."""


def checksums(model: Any) -> dict[str, float]:
    """A float64 sum of each trainable parameter this rank holds whole (sharded ones skipped)."""
    import torch

    return {
        name: float(torch.sum(p.detach(), dtype=torch.float64))
        for name, p in model.named_parameters()
        if p.requires_grad and not _sharded(p)
    }


def _sharded(param: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) or hasattr(param, "ds_id") or param.is_meta


def differing(per_rank: list[dict[str, float]]) -> list[str]:
    """Names of the parameters whose sums are not the same on every rank (or that some ranks lack)."""
    names = set().union(*per_rank)
    return sorted(n for n in names if len({ranked.get(n) for ranked in per_rank}) > 1)


def broadcasts_rank0() -> bool:
    """Whether the engine accelerate set up hands every rank rank 0's parameters when it wraps the model."""
    state = _dist.accelerator_state()
    fsdp = getattr(state, "fsdp_plugin", None) if state is not None else None
    return fsdp is None or bool(getattr(fsdp, "cpu_ram_efficient_loading", False))


def check_replicas_agree(model: Any) -> None:
    """Collective. Refuse (every rank) when the ranks' trainable parameters differ and the engine would train a mix.
    An engine that broadcasts rank 0's copy is not checked: there a difference is harmless, and expected (FSDP2's
    ``cpu_ram_efficient_loading`` leaves the other ranks' loaded weights uninitialised for the broadcast)."""
    if _dist.world_size() < 2 or model is None or broadcasts_rank0():
        return
    bad = differing(_dist.gather_objects(checksums(model)))
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ReplicaMismatchError(
            f"the {_dist.world_size()} ranks hold different trainable parameters ({len(bad)}: {shown}): FSDP2 would "
            f"shard and train a mix of them; {FIX}"
        )
