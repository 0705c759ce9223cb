"""Process-group bootstrap for ``torchrun --max-restarts``: each restart round gets its own rendezvous keys."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

logger = logging.getLogger("hf_dist")

SHARED_STORE_FIX = (
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun --rdzv-backend c10d, so that each round gets a store "
    "of its own (examples/slurm/torchrun_multinode.sbatch does)"
)


def store_round(env: Mapping[str, str] = os.environ) -> str | None:
    """The name every rank of this launch round agrees on, to key the rendezvous store by round.

    - ``""``: the store is new each round (torchrun's c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
      rank 0 hosts a store on a port picked for the round), so no key of a dead round can be read.
    - ``"attempt_N"``: one agent (one node) hosts a store that outlives its restarts; its restart count ``N`` is the
      round, the same for all its ranks.
    - ``None``: several agents share one store across rounds (c10d's default, or a static multi-node rendezvous).
      Only the agent whose worker failed counts a restart, so the nodes' counts differ after one (measured under
      examples/slurm/torchrun_multinode.sbatch: 1 on the failed node, 0 on the other) and no round name is shared.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    if int(env.get("GROUP_WORLD_SIZE") or 1) == 1:
        return f"attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return None


def round_name(env: Mapping[str, str] = os.environ) -> str:
    """:func:`store_round`, or where no round is shared, this agent's restart count (right until the first restart)."""
    name = store_round(env)
    return f"attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}" if name is None else name


def init_distributed_for_restarts(backend: str | None = None, *, timeout_s: float = 1800) -> bool:
    """Initialize torch.distributed so a ``torchrun --max-restarts`` restart cannot read the dead attempt's addresses.

    With torchrun's default static rendezvous the agent keeps one TCPStore across restarts, and
    the default process group's keys (gloo peer addresses, NCCL unique id) are not namespaced by
    attempt: a restarted rank can read its dead peer's address and hang or fail in
    ``init_process_group`` (measured: gloo "connectFullMesh failed ... Connection refused").
    Call this first thing in the training script (the recipes do); it prefixes the keys with the round
    (:func:`store_round`). accelerate and the Trainer then reuse the initialized group. Returns False (and does
    nothing) outside torchrun or when a process group already exists. Several nodes sharing one store across
    restarts cannot name a round: warned on rank 0 when restarts are allowed (:data:`SHARED_STORE_FIX`).
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
    if store_round() is None and rank == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0:
        nodes = os.environ.get("GROUP_WORLD_SIZE")
        logger.warning("hf_dist: %s nodes share one rendezvous store across restarts, so a restart would hang in "
                       "init_process_group; %s", nodes, SHARED_STORE_FIX)  # fmt: skip
    if name := round_name():
        store = dist.PrefixStore(f"hf_dist/{name}", store)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return True
