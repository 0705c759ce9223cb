"""What the recipes refuse before any model is built that no library call would refuse early: the output folder's
state, a model name the hub cannot serve, and an engine that CPU ranks would not run as asked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def check_output_dir(output_dir: str, *, resuming: bool) -> None:
    """Refuse an ``--output_dir`` that cannot be a run's folder: a file (or below one), a folder that cannot be
    written, or, for a fresh run (``resuming`` False), a folder holding another run's ``checkpoint-N``."""
    path = Path(output_dir)
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        what = "is a file, not a folder" if existing == path else f"lies below {existing}, which is a file"
        raise ValueError(f"--output_dir {output_dir} {what}: pass a folder (it is created when missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {output_dir}: {existing} is not writable; pass a folder you can write to")
    if not resuming:
        _refuse_earlier_checkpoints(output_dir)


def _refuse_earlier_checkpoints(output_dir: str) -> None:
    """A fresh run into a folder holding another run's ``checkpoint-N`` would interleave its checkpoints with
    theirs (and an export, a later ``auto`` resume, could pick theirs): continuing or replacing must be chosen."""
    from hf_dist.checkpoint.formats.names import list_checkpoints

    found = [Path(path).name for _, path in reversed(list_checkpoints(output_dir))]
    if found:
        raise ValueError(
            f"--output_dir {output_dir} already holds checkpoints of an earlier run ({', '.join(found[:4])}"
            f"{', ...' if len(found) > 4 else ''}) and --resume_from_checkpoint is not set. Continue that run with "
            "--resume_from_checkpoint auto, or start afresh in another --output_dir (or delete its checkpoint-* "
            "folders)"
        )


def check_model_source(model_args: Any) -> None:
    """A model or tokenizer named on the hub (not a local path) while the hub cannot be reached: refused in about a
    second, as ``hf-dist plan`` does, instead of a minute of retries from every rank
    (:func:`hf_dist.planning.model_source.check_hub_reachable`; under ``HF_HUB_OFFLINE`` only the cache answers)."""
    from hf_dist.planning.model_source import check_hub_reachable

    for name in dict.fromkeys((model_args.model_name_or_path, model_args.tokenizer_name_or_path)):
        if name and not os.path.exists(name):
            check_hub_reachable(name)


def check_engine_runs_here(args: Any, *, has_accelerator: bool) -> None:
    """Refuse, from the ``TrainingArguments``, an engine that accelerate would not run as asked on CPU ranks: FSDP
    (silently replaced by DDP) without ``--fsdp_on_cpu``, DeepSpeed (silently replaced) under ``use_cpu`` /
    ``ACCELERATE_USE_CPU``, and tensor / context / sequence parallelism outside DeepSpeed (``ParallelismConfig``
    refused on CPU ranks) without ``--model_parallel_on_cpu``. The run's own check of what accelerate built
    (:func:`hf_dist.recipe_utils.run.check_strategy`) stays, for what this cannot foresee."""
    if has_accelerator:
        return
    from hf_dist.runtime.cpu_fsdp import fsdp_on_cpu_enabled, parallelism_config_on_cpu_allowed

    cpu_env = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if args.fsdp and not fsdp_on_cpu_enabled():
        raise ValueError(
            "FSDP on CPU ranks (the plan's, or your --fsdp / accelerate FSDP config): accelerate would silently train "
            "DDP instead. Pass --fsdp_on_cpu (tests and CPU development only), or train on GPUs"
        )
    if args.deepspeed and (args.use_cpu or cpu_env):
        raise ValueError(
            "DeepSpeed on CPU ranks with use_cpu / ACCELERATE_USE_CPU=1: accelerate would silently train DDP instead. "
            "Launch with ACCELERATE_USE_CPU=false (and --deepspeed_on_cpu for several ranks), or train on GPUs"
        )
    sizes = _parallel_sizes(args)
    if sizes and not args.deepspeed and not args.fsdp and not parallelism_config_on_cpu_allowed():
        given = " ".join(f"--{name}_size {size}" for name, size in sizes.items())
        raise ValueError(
            f"{given} on CPU ranks: accelerate refuses a ParallelismConfig there (DistributedType.MULTI_CPU). Pass "
            "--model_parallel_on_cpu (tests and CPU development only), or train on GPUs"
        )


def _parallel_sizes(args: Any) -> dict[str, int]:
    """The tensor / context / sequence parallel sizes above 1 that ``args`` asks accelerate for."""
    pc = getattr(args, "parallelism_config", None)
    sizes = {name: int(getattr(pc, f"{name}_size", 1) or 1) for name in ("tp", "cp", "sp")}
    return {name: size for name, size in sizes.items() if size > 1}
