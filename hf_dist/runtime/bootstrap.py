"""Process-group bootstrap for ``torchrun --max-restarts``: each restart gets its own rendezvous keys."""

from __future__ import annotations

import os


def init_distributed_for_restarts(backend: str | None = None, *, timeout_s: float = 1800) -> bool:
    """Initialize torch.distributed so a ``torchrun --max-restarts`` restart cannot read the dead attempt's addresses.

    With torchrun's default static rendezvous the agent keeps one TCPStore across restarts, and
    the default process group's keys (gloo peer addresses, NCCL unique id) are not namespaced by
    attempt: a restarted rank can read its dead peer's address and hang or fail in
    ``init_process_group`` (measured: gloo "connectFullMesh failed ... Connection refused").
    Call this first thing in the training script; it prefixes the keys with the restart count.
    accelerate and the Trainer then reuse the initialized group. Returns False (and does nothing)
    outside torchrun or when a process group already exists.
    """
    import datetime

    import torch
    import torch.distributed as dist

    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or dist.is_initialized():
        return False
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True); otherwise rank 0 does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world, is_master=not agent_store and rank == 0, timeout=timeout)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    prefixed = dist.PrefixStore(f"hf_dist/attempt_{attempt}", store)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    return True
