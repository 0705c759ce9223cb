"""Checkpoint and resume a model sharded at load time (tensor parallelism, FSDP2 x TP), which the Trainer cannot.

A model loaded with ``from_pretrained(tp_plan="auto")`` or ``distributed_config=...`` holds DTensor parameters
that transformers placed itself. The Trainer (transformers 5.x) refuses to save its optimizer ("Resuming is not
supported for models sharded at load time ... Pass ``save_only_model=True``") and, on resume, copies the gathered
``model.safetensors`` into those parameters, which torch refuses ("aten.copy_.default got mixed torch.Tensor
and DTensor"). hf_dist closes both gaps with ``torch.distributed.checkpoint``:

* :func:`accept_full_state_dict`: the model loads a full (gathered) state dict; each plain tensor bound for a
  DTensor parameter is cut to that parameter's placements on its own rank (``distribute_tensor(...,
  src_data_rank=None)``: every rank already holds the whole tensor, nothing is sent). The Trainer's own weight
  load on resume then works.
* :func:`save_optimizer_state`: the optimizer as DCP in ``hf_dist_optimizer/`` (``.metadata`` + one
  ``__R_0.distcp`` per rank, keyed by parameter name through ``get_optimizer_state_dict``) and the LR
  scheduler as JSON (``hf_dist_scheduler.json``).
* :func:`load_optimizer_state`: loads them into whatever layout DCP can reshard to: the same TP size, FSDP2 x TP
  on more ranks, or plain replicated parameters (DDP).
* :func:`save_rng_state`: each rank's random generators as the Trainer's own ``rng_state_R.pth``, which
  ``save_only_model`` leaves out; the Trainer restores them itself on resume (``Trainer._load_rng_state``).

:class:`hf_dist.callbacks.resume.ShardedResumeCallback` calls these at each save and when a run resumes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from hf_dist.atomic_io import atomic_write_json
from hf_dist.checkpoint.formats.names import DCP_METADATA, rng_state_name
from hf_dist.checkpoint.formats.names import SHARDED_OPTIMIZER_DIR as OPTIMIZER_DIR
from hf_dist.checkpoint.safety.paths import ConfinedFolder
from hf_dist.runtime import dist as _dist

SCHEDULER_FILE = "hf_dist_scheduler.json"


def has_dtensor_params(model: torch.nn.Module) -> bool:
    """True when some parameter is a DTensor: before accelerate prepares anything, the model was sharded at load."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def has_optimizer_state(checkpoint_dir: str | os.PathLike) -> bool:
    return ConfinedFolder(Path(checkpoint_dir)).is_file(f"{OPTIMIZER_DIR}/{DCP_METADATA}")


def accept_full_state_dict(model: torch.nn.Module) -> None:
    """Let ``model.load_state_dict`` take full tensors for its DTensor parameters (see the module docstring).

    A tensor whose shape differs from its parameter's global shape is left alone, so ``load_state_dict``
    still reports the mismatch.
    """
    if getattr(model, "_hf_dist_accepts_full_state_dict", False):
        return
    model.register_load_state_dict_pre_hook(_full_to_placements)
    model._hf_dist_accepts_full_state_dict = True


def _full_to_placements(module: torch.nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, target in (*module.named_parameters(), *module.named_buffers()):
        value = state_dict.get(prefix + name)
        if not isinstance(target, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            continue
        if tuple(value.shape) == tuple(target.shape):
            state_dict[prefix + name] = distribute_tensor(
                value, target.device_mesh, target.placements, src_data_rank=None
            )


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def save_optimizer_state(
    checkpoint_dir: str | os.PathLike, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None
) -> Path:
    """Write the optimizer (DCP, every rank its shards) and the scheduler (JSON, rank 0); call on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    scheduler_state = None if lr_scheduler is None else _json_state(lr_scheduler)  # every rank fails alike
    own = ConfinedFolder(Path(checkpoint_dir))
    folder = own.path(OPTIMIZER_DIR)
    state = get_optimizer_state_dict(model, _torch_optimizer(optimizer))
    dcp.save({"optimizer": state}, checkpoint_id=str(folder))
    if scheduler_state is not None and _dist.rank() == 0:
        atomic_write_json(own.path(SCHEDULER_FILE), scheduler_state)
    return folder


def save_rng_state(checkpoint_dir: str | os.PathLike, world_size: int) -> Path:
    """This rank's random generators in the file and format ``Trainer._save_rng_state`` writes (python, numpy, torch
    CPU and, on CUDA, every device's generator), which ``Trainer._load_rng_state`` reads back; call on every rank."""
    import io
    import random

    import numpy as np

    from hf_dist.atomic_io import atomic_write_bytes

    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all() if world_size > 1 else torch.cuda.random.get_rng_state()
    name = rng_state_name(_dist.rank(), world_size)
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return atomic_write_bytes(ConfinedFolder(Path(checkpoint_dir)).path(name), buffer.getvalue())


def _json_state(lr_scheduler: Any) -> dict:
    state = lr_scheduler.state_dict()
    try:
        json.dumps(state)
    except TypeError as exc:
        raise TypeError(
            f"cannot save the state of {type(lr_scheduler).__name__} as JSON ({exc}); hf_dist saves the scheduler "
            "of a model sharded at load as JSON. Use one of the Trainer's lr_scheduler_type values"
        ) from exc
    return state


def load_optimizer_state(
    checkpoint_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any,
    lr_scheduler: Any = None,
    *,
    trust_pickles: bool = False,
) -> None:
    """Load what :func:`save_optimizer_state` wrote into this run's optimizer, resharded by DCP to its layout.

    DCP unpickles ``.metadata`` and the non-tensor values (``param_groups``) without ``weights_only``: the load runs
    under :func:`~hf_dist.checkpoint.safety.loading.guarded_loads`, which gives both the safe unpicklers and keeps
    every file it opens inside the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from hf_dist.checkpoint.safety.loading import guarded_loads

    own = ConfinedFolder(Path(checkpoint_dir))
    folder = own.path(OPTIMIZER_DIR)
    optim = _torch_optimizer(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, optim)}  # the target layout, state created if lazy
    with guarded_loads(checkpoint_dir, trust_pickles=trust_pickles):
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))
    set_optimizer_state_dict(model, optim, state["optimizer"])
    scheduler_file = own.path(SCHEDULER_FILE)
    if lr_scheduler is not None and scheduler_file.is_file():
        lr_scheduler.load_state_dict(json.loads(scheduler_file.read_text()))
