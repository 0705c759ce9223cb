"""The process group and what accelerate really built (no-ops in one process).

``live_strategy`` names the strategy that is really running (the registry's name, read from accelerate's
state); callbacks, auto-resume and the recipes ask it. ``shutdown()`` is the last call of the recipes and
of every launched script.
"""

from __future__ import annotations

from typing import Any


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank; a no-op when training in one process."""
    if is_distributed():
        import torch.distributed as dist

        dist.barrier()


def shutdown() -> None:
    """End a distributed script: wait for every rank, then destroy the process group; a no-op in one process.

    Call it last, on every rank. A rank that simply exits leaves its process group to be torn down during
    interpreter shutdown, in whatever order Python and C++ destroy their objects, while the other ranks may
    still be running; gloo can abort the process there (SIGABRT after a finished run, seen on CPU CI), and
    the launcher then reports the whole job failed — and restarts it under ``--max-restarts``.
    """
    if is_distributed():
        import torch.distributed as dist

        barrier()
        dist.destroy_process_group()


def world_size() -> int:
    if is_distributed():
        import torch.distributed as dist

        return dist.get_world_size()
    return 1


def rank() -> int:
    if is_distributed():
        import torch.distributed as dist

        return dist.get_rank()
    return 0


def gather_floats(values: list[float]) -> list[list[float]]:
    """All ranks' ``values`` (same length on every rank), indexed by rank; collective."""
    if not is_distributed():
        return [list(values)]
    import torch
    import torch.distributed as dist

    # NCCL only moves CUDA tensors; gloo only CPU ones.
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def gather_objects(value: Any) -> list[Any]:
    """All ranks' picklable ``value``, indexed by rank; collective."""
    if not is_distributed():
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast_object(value: Any) -> Any:
    """Rank 0's picklable ``value`` on every rank; collective (in one process: ``value``)."""
    if not is_distributed():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def accelerator_state() -> Any | None:
    """accelerate's shared AcceleratorState when the Trainer has created one, else None."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover - accelerate ships with transformers' Trainer
        return None
    if not AcceleratorState._shared_state:
        return None
    return AcceleratorState()


def live_strategy(args: Any = None) -> str:
    """The strategy that is really running, by its registry name: 'ddp', 'zero1'..'zero3', 'fsdp_full_shard',
    'fsdp_shard_grad_op' or 'hsdp' (:data:`hf_dist.planning.layout.REGISTRY`).

    Read from accelerate's state (what the Trainer actually built), not from the arguments:
    accelerate silently drops FSDP on CPU, so ``args.fsdp`` alone would lie.
    """
    state = accelerator_state()
    if state is not None:
        ds = getattr(state, "deepspeed_plugin", None)
        if ds is not None:
            return _zero_strategy_name(ds.zero_stage)
        fsdp = getattr(state, "fsdp_plugin", None)
        if fsdp is not None:
            return _fsdp_strategy(fsdp).name
        return "ddp"
    ds_config = deepspeed_config(args)
    if ds_config:  # before the Trainer built its accelerator
        return _zero_strategy_name(ds_config.get("zero_optimization", {}).get("stage", 0))
    return "ddp"


def deepspeed_config(args: Any) -> dict:
    """The DeepSpeed config dict ``TrainingArguments(deepspeed=...)`` resolved (``{}`` without DeepSpeed)."""
    return getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}


def parallel_sizes(parallelism_config: Any = None, ds_config: dict | None = None) -> dict[str, int]:
    """``{"tp": .., "cp": .., "sp": ..}`` (1 when unused) from accelerate's ``ParallelismConfig`` and, for DeepSpeed
    AutoTP, the DeepSpeed config's ``tensor_parallel.autotp_size``."""
    sizes = {name: int(getattr(parallelism_config, f"{name}_size", 1) or 1) for name in ("tp", "cp", "sp")}
    autotp = int(((ds_config or {}).get("tensor_parallel") or {}).get("autotp_size", 1) or 1)
    if autotp > 1:
        sizes["tp"] = autotp
    return sizes


def _zero_strategy_name(stage: Any) -> str:
    from hf_dist.planning.layout import zero_stage_strategy

    try:
        return zero_stage_strategy(int(stage)).name
    except ValueError:  # ZeRO-0 runs but is no strategy of hf_dist's; named for the logs
        return f"zero{int(stage)}"


def _fsdp_strategy(plugin: Any):
    """The registry strategy of accelerate's FSDP plugin (FSDP2: ``reshard_after_forward``; FSDP1: the enum)."""
    reshard = getattr(plugin, "reshard_after_forward", None)
    if isinstance(reshard, bool):  # FSDP2
        return fsdp_strategy_named_in("full_shard" if reshard else "shard_grad_op")
    return fsdp_strategy_named_in(str(getattr(plugin, "sharding_strategy", reshard)))  # ShardingStrategy.HYBRID_SHARD


def fsdp_strategy_named_in(text: str):
    """The FSDP strategy whose sharding mode ``text`` names (``"shard_grad_op auto_wrap"``,
    ``"ShardingStrategy.HYBRID_SHARD"``); full shard when it names none (``TrainingArguments(fsdp=True)``)."""
    from hf_dist.planning.layout import fsdp_mode_strategy

    lowered = text.lower()
    for mode in ("hybrid_shard", "shard_grad_op"):
        if mode in lowered:
            return fsdp_mode_strategy(mode)
    return fsdp_mode_strategy("full_shard")


def live_wrap_classes() -> list[str] | None:
    """FSDP auto-wrap class names of the running job, or None when FSDP is not active."""
    state = accelerator_state()
    fsdp = getattr(state, "fsdp_plugin", None) if state is not None else None
    if fsdp is None:
        return None
    names = getattr(fsdp, "transformer_cls_names_to_wrap", None) or []
    return sorted([names] if isinstance(names, str) else names)
