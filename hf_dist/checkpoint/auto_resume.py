"""``auto_resume``: the newest complete checkpoint of a run, checked against the run about to resume it.

``auto_resume(output_dir)`` returns the newest ``checkpoint-N`` whose completion marker exists and whose files
still match it (:mod:`hf_dist.checkpoint.marker`), so ``trainer.train(resume_from_checkpoint=auto_resume(out))``
is always safe. Given the run's strategy or ``TrainingArguments`` it also checks that the checkpoint's family
(:class:`~hf_dist.planning.layout.CheckpointFamily`, read by :func:`hf_dist.checkpoint.layout.read_layout`) is
the one that strategy writes and reads, and that a ZeRO checkpoint matches the world size or was resharded.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.layout import LATEST_UNIVERSAL, read_layout
from hf_dist.checkpoint.marker import MARKER_NAME, incomplete_reasons, unmarked_reasons
from hf_dist.planning.layout import strategy, zero_stage_strategy

logger = logging.getLogger(__name__)

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` folder in ``output_dir``, newest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), str(p)) for p in root.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return sorted(found, reverse=True)


def auto_resume(
    output_dir: str | os.PathLike,
    *,
    strategy: Any = None,
    world_size: int | None = None,
    checksums: bool = False,
    training_args: Any = None,
    trust_pickles: bool = False,
    fresh_start: bool = False,
) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``; None only when there is none at all (or
    ``fresh_start=True``). Partial checkpoints are skipped, and if checkpoints exist but none can be proven
    complete it raises, naming each one's problem: it never silently starts over a run's own checkpoints.

    Complete means hf_dist's marker (written by :func:`hf_dist.callbacks.default`'s callbacks) matches the files,
    or, for a run without those callbacks, the Trainer's own files prove it
    (:func:`~hf_dist.checkpoint.marker.unmarked_reasons`: ``trainer_state.json`` at step N, every rank's files of
    the live world size, DCP metadata, untruncated safetensors).

    ``training_args`` (the run's ``TrainingArguments``, before the Trainer is built) also prepares the
    checkpoint for this run with :func:`hf_dist.checkpoint.reshard.prepare_resume`: a DeepSpeed ZeRO checkpoint saved
    by another number of ranks is converted once to DeepSpeed's universal format and ``load_universal`` is
    switched on in the run's DeepSpeed config; a checkpoint of another strategy raises, naming
    ``hf-dist convert``. Call it on every rank (rank 0 converts, the others wait)::

        args = TrainingArguments(...)
        resume = hf_dist.auto_resume(args.output_dir, training_args=args)
        Trainer(model, args, callbacks=hf_dist.callbacks.default(), ...).train(resume_from_checkpoint=resume)

    ``strategy`` (a strategy name such as ``"fsdp_full_shard"``, or the ``Trainer`` about to run) only
    checks, and raises a RuntimeError naming ``hf-dist convert`` / ``hf-dist reshard`` when the checkpoint
    cannot be loaded by that strategy and world size::

        trainer.train(resume_from_checkpoint=hf_dist.auto_resume(args.output_dir, strategy=trainer))

    Either way the checkpoint's family must match the run (a ZeRO-3 checkpoint for a ZeRO-2 run, or DDP
    weights for an FSDP run, raise), and every pickle in it passes the loading gate (:func:`gate_checkpoint`;
    a foreign type raises :class:`~hf_dist.checkpoint.safe_pickle.UnsafePickleError` unless ``trust_pickles``).
    Malformed markers make a checkpoint "not complete", with the reason in the log.
    """
    _check_output_dir(output_dir)
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        logger.info("auto_resume: no checkpoint-N folder in %s; starting from scratch", output_dir)
    live_world = _live_world_size(world_size, training_args, strategy)
    skipped = []
    for step, path in checkpoints:
        reasons = _not_resumable(path, live_world, checksums)
        if reasons:
            logger.warning("auto_resume: skipping %s: %s", path, "; ".join(reasons))
            skipped.append(f"  {Path(path).name}: {'; '.join(reasons)}")
            continue
        if training_args is not None:
            from hf_dist.checkpoint.reshard import prepare_resume

            path = prepare_resume(path, world_size, training_args=training_args, trust_pickles=trust_pickles)
        else:
            if strategy is not None:
                name, live_world = _strategy_and_world(strategy, world_size)
                check_resume_compatible(path, name, world_size=live_world)
            gate_checkpoint(path, trust_pickles=trust_pickles)
        logger.info("auto_resume: resuming from %s (step %d)", path, step)
        return path
    if skipped and not fresh_start:
        raise RuntimeError(
            f"auto_resume: {output_dir} holds {len(skipped)} checkpoint(s) and none can be proven complete, so "
            "resuming could load a half-written save and starting over would overwrite them:\n"
            + "\n".join(skipped)
            + "\nRe-copy a checkpoint's missing files if you have them; otherwise move or delete these folders, or "
            "pass fresh_start=True to start from step 0 in this folder."
        )
    return None


def _not_resumable(path: str, live_world: int, checksums: bool) -> list[str]:
    """Why ``path`` cannot be resumed: its marker's reasons, or without a marker the Trainer files' proof."""
    if (Path(path) / MARKER_NAME).exists():
        return incomplete_reasons(path, checksums=checksums)
    reasons = unmarked_reasons(path, live_world)
    if not reasons:
        logger.info("auto_resume: %s has no %s (hf_dist's callbacks were not attached); proved complete from the "
                    "Trainer's own files", path, MARKER_NAME)  # fmt: skip
        return []
    return [f"no {MARKER_NAME} and the Trainer's files do not prove it complete: " + "; ".join(reasons)]


def _live_world_size(world_size: int | None, training_args: Any, running: Any) -> int:
    """The ranks of the run about to resume: given, from its TrainingArguments or Trainer, else the launcher's."""
    for source in (training_args, getattr(running, "args", None)):
        if world_size is None and source is not None:
            world_size = getattr(source, "world_size", None)
    return int(world_size or os.environ.get("WORLD_SIZE", 1))


def gate_checkpoint(path: str | os.PathLike, *, trust_pickles: bool = False) -> None:
    """The loading gate for a checkpoint about to be resumed: every pickle in it is checked before the Trainer,
    accelerate or DeepSpeed unpickles it (DeepSpeed with ``weights_only=False``, DCP's ``.metadata`` with
    plain ``pickle.load``). The completion marker proves only that every rank finished writing, not who
    wrote the files, so this runs whatever the marker says."""
    from hf_dist.checkpoint.safe_pickle import check_pickles

    check_pickles(path, trust_pickles=trust_pickles)


def _check_output_dir(output_dir: str | os.PathLike) -> None:
    root = Path(output_dir)
    if _CHECKPOINT_RE.match(root.name) or (root / MARKER_NAME).is_file() or (root / "trainer_state.json").is_file():
        raise ValueError(
            f"auto_resume got {root}, which is a checkpoint folder itself.\n"
            f"  Pass the run's output_dir that holds the checkpoint-N folders: {root.parent}\n"
            f"  or pass {root} to trainer.train(resume_from_checkpoint=...) directly"
        )


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
    return "ddp"


def _strategy_and_world(running: Any, world_size: int | None) -> tuple[str, int | None]:
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
    layout = read_layout(checkpoint_dir, strict=False)
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
    universal = (Path(checkpoint_dir) / LATEST_UNIVERSAL).is_file()
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
            f'"checkpoint": {{"load_universal": true}}), or call hf_dist.checkpoint.reshard.prepare_resume(...) before '
            f"creating the Trainer, or launch {layout.world_size} ranks."
        )
