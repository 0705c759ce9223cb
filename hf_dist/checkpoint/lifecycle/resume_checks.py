"""The checks a checkpoint passes before a run resumes it, shared by ``auto_resume`` and ``reshard.prepare_resume``.

- :func:`gate_checkpoint`: the checkpoint loads as its resume will load it (early refusal);
- :func:`check_resume_compatible`: the checkpoint's family (:class:`~hf_dist.planning.layout.CheckpointFamily`, read
  by :func:`hf_dist.checkpoint.formats.checkpoint_folder.open_checkpoint`) is the one the run's strategy reads, and a
  ZeRO checkpoint matches the world size or was resharded; :func:`check_strategy_matches` asks it with the strategy of
  the run's ``TrainingArguments`` (:func:`strategy_of_args`);
- :func:`check_autotp_matches`: a DeepSpeed AutoTP checkpoint is resumed on the layout that wrote it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint
from hf_dist.checkpoint.formats.contents import CheckpointContents
from hf_dist.checkpoint.formats.names import LATEST_UNIVERSAL
from hf_dist.planning.layout import strategy, zero_stage_strategy


def gate_checkpoint(path: str | os.PathLike, *, trust_pickles: bool = False) -> None:
    """A checkpoint about to be resumed, loaded now as the resume will load it
    (:func:`~hf_dist.checkpoint.safety.loading.check_loadable`: torch's ``weights_only`` unpickler, links confined),
    so a refusal comes before any Trainer is built. The loads themselves are guarded where they happen
    (:func:`~hf_dist.checkpoint.safety.loading.guarded_loads`, installed on the Trainer by ``attach``); this is the
    early message, not the safety."""
    from hf_dist.checkpoint.safety.loading import check_loadable

    check_loadable(path, trust_pickles=trust_pickles)


def strategy_of_args(training_args: Any) -> str | None:
    """The strategy ``TrainingArguments`` asks for ('ddp', 'zero1/2/3', 'fsdp_full_shard', ...), before any Trainer.

    None when it cannot tell (a DeepSpeed config without a ZeRO stage hf_dist runs).
    """
    ds = getattr(getattr(training_args, "hf_deepspeed_config", None), "config", None)
    if ds is None:
        ds = getattr(training_args, "deepspeed", None)
        if isinstance(ds, (str, os.PathLike)):
            try:
                ds = json.loads(Path(ds).read_text())
            except (OSError, ValueError):
                return None
    if ds:
        stage = ds.get("zero_optimization", {}).get("stage", 0) if isinstance(ds, dict) else 0
        try:
            return zero_stage_strategy(int(stage)).name
        except (TypeError, ValueError):  # stage 0 or "auto": not one of hf_dist's strategies
            return None
    fsdp = getattr(training_args, "fsdp", None)  # "full_shard auto_wrap", [FSDPOption.SHARD_GRAD_OP, ...], True
    if fsdp:
        from hf_dist.runtime.dist import fsdp_strategy_named_in

        options = fsdp if isinstance(fsdp, (list, tuple)) else [fsdp]
        return fsdp_strategy_named_in(" ".join(str(getattr(o, "value", o)) for o in options)).name
    return strategy_of_accelerate_env()


def strategy_of_accelerate_env() -> str | None:
    """The strategy an ``accelerate launch --config_file`` YAML chose, from the environment it gives each rank
    (``ACCELERATE_USE_FSDP``/``ACCELERATE_USE_DEEPSPEED``: the Trainer applies it only when it builds its
    Accelerator, so ``TrainingArguments`` do not show it yet); 'ddp' when it chose neither, None when it cannot tell."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        try:
            return zero_stage_strategy(int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", ""))).name
        except (TypeError, ValueError):  # a DeepSpeed config file, or a stage hf_dist does not run
            return None
    if env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        from hf_dist.runtime.dist import fsdp_strategy_named_in

        reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "").lower()
        mode = "shard_grad_op" if reshard == "false" else env.get("FSDP_SHARDING_STRATEGY", "")
        return fsdp_strategy_named_in(mode).name
    return "ddp"


def strategy_and_world(running: Any, world_size: int | None) -> tuple[str, int | None]:
    if isinstance(running, str):
        return running, world_size
    # A Trainer: its accelerator already decided what really runs.
    from hf_dist.runtime import dist as _dist

    args = getattr(running, "args", None)
    return _dist.live_strategy(args), world_size or getattr(args, "world_size", None)


def check_resume_compatible(
    checkpoint_dir: str | os.PathLike, strategy_name: str, *, world_size: int | None = None
) -> None:
    """Raise RuntimeError when ``strategy_name`` on ``world_size`` ranks cannot load ``checkpoint_dir``."""
    wanted = strategy(strategy_name).checkpoint
    checkpoint = open_checkpoint(checkpoint_dir, strict=False)
    layout = checkpoint.contents
    if layout.family is not wanted:
        raise RuntimeError(
            f"cannot resume a {strategy_name} run from {checkpoint_dir}:\n"
            f"  it holds {layout.family.text}, this run needs {wanted.text}; the Trainer would fail or silently drop "
            "the optimizer state.\n"
            "  Keep the strategy the checkpoint was written with, or export the weights with\n"
            f"    hf-dist convert {checkpoint_dir} OUT_DIR\n"
            "  and start a new run from OUT_DIR (`hf-dist reshard` changes the number of ranks of a same-strategy "
            "checkpoint)."
        )
    # FSDP's DCP files reshard on load and full checkpoints are replicated: only ZeRO is tied to its world size,
    # until DeepSpeed's universal checkpoint (``latest_universal``, made by `hf-dist reshard`) exists.
    universal = checkpoint.files.is_file(LATEST_UNIVERSAL)
    if (
        layout.family.is_zero
        and not universal
        and world_size
        and layout.world_size
        and layout.world_size != world_size
    ):
        raise RuntimeError(
            f"cannot resume from {checkpoint_dir} on {world_size} ranks: its {layout.family.text} were "
            f"written by {layout.world_size} ranks and DeepSpeed refuses another world size. Run "
            f"`hf-dist reshard {checkpoint_dir}` (adds a universal checkpoint; then resume with "
            f'"checkpoint": {{"load_universal": true}}), or call hf_dist.checkpoint.lifecycle.reshard.prepare_resume(...) before '
            f"creating the Trainer, or launch {layout.world_size} ranks."
        )


def check_strategy_matches(layout: CheckpointContents, training_args: Any) -> None:
    """The family check of ``auto_resume(strategy=...)`` (:func:`check_resume_compatible`), with the strategy
    ``training_args`` asks for."""
    if training_args is None:
        return
    strategy = strategy_of_args(training_args)
    if strategy is not None:
        check_resume_compatible(layout.root, strategy)


def check_autotp_matches(layout: CheckpointContents, training_args: Any, world_size: int) -> None:
    """DeepSpeed loads an AutoTP checkpoint only at the TP size and world size it was written with."""
    if not layout.family.is_zero or training_args is None:
        return
    from hf_dist.runtime.dist import deepspeed_config, parallel_sizes

    tp = parallel_sizes(None, deepspeed_config(training_args))["tp"]
    if layout.tp_size == tp and (tp == 1 or layout.world_size == world_size):
        return
    raise ValueError(
        f"{layout.describe()} was written with DeepSpeed AutoTP size {layout.tp_size} on {layout.world_size} ranks; "
        f"this run has AutoTP size {tp} on {world_size} ranks. DeepSpeed loads an AutoTP checkpoint only on the "
        f"layout that wrote it: resume with autotp_size {layout.tp_size} on {layout.world_size} ranks, or export the "
        "weights with hf-dist convert and start a new run from them"
    )
