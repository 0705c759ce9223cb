"""``auto_resume``: the newest complete checkpoint of a run, checked against the run about to resume it.

``auto_resume(output_dir)`` returns the newest ``checkpoint-N`` whose manifest matches what is on disk, file by file,
sizes and SHA-256 (:mod:`hf_dist.checkpoint.lifecycle.manifest`), or, without a manifest, whose files prove it
complete (:mod:`hf_dist.checkpoint.lifecycle.proof`), and that belongs to the run that last trained in the folder
(:mod:`hf_dist.checkpoint.output.runs`), so ``trainer.train(resume_from_checkpoint=auto_resume(out))`` is always
safe. Given the run's strategy or ``TrainingArguments`` it also checks that the checkpoint's family
(:class:`~hf_dist.planning.layout.CheckpointFamily`, read by :func:`hf_dist.checkpoint.formats.contents.read_contents`) is
the one that strategy writes and reads, and that a ZeRO checkpoint matches the world size or was resharded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder, open_checkpoint
from hf_dist.checkpoint.formats.names import (
    CHECKPOINT_DIR_RE,
    MANIFEST_NAME,
    is_checkpoint_dir,
    list_checkpoints,
)
from hf_dist.checkpoint.formats.trainer_state import saved_step
from hf_dist.checkpoint.lifecycle import manifest, proof
from hf_dist.checkpoint.lifecycle.finished import finished_at, finished_message
from hf_dist.checkpoint.lifecycle.reshard import prepare_resume
from hf_dist.checkpoint.lifecycle.resume_checks import check_resume_compatible, gate_checkpoint, strategy_and_world
from hf_dist.checkpoint.output import runs
from hf_dist.checkpoint.output.lock import check_output_dir_free
from hf_dist.checkpoint.safety.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)


def auto_resume(
    output_dir: str | os.PathLike,
    *,
    strategy: Any = None,
    world_size: int | None = None,
    training_args: Any = None,
    trust_pickles: bool = False,
    fresh_start: bool = False,
    announce: bool = True,
) -> str | None:
    """The newest complete ``checkpoint-N`` in ``output_dir``; None only when there is none at all (or
    ``fresh_start=True``). Partial checkpoints are skipped, and if checkpoints exist but none can be proven
    complete it raises, naming each one's problem: it never silently starts over a run's own checkpoints.

    Complete means hf_dist's manifest (written by :func:`hf_dist.callbacks.default`'s callbacks) matches the files on
    disk, sizes and content (with several ranks launched, each hashes its share), or, for a run without those
    callbacks, every file its strategy writes is there and readable
    (:func:`~hf_dist.checkpoint.lifecycle.proof.unproven_reasons`). A checkpoint newer than the step the folder's last
    run started from must be that run's (:func:`~hf_dist.checkpoint.output.runs.lineage_reason`): one a rolled-back
    run left behind is skipped, named.

    ``training_args`` (the run's ``TrainingArguments``, before the Trainer is built) also prepares the
    checkpoint for this run with :func:`hf_dist.checkpoint.lifecycle.reshard.prepare_resume`: a DeepSpeed ZeRO checkpoint saved
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
    a foreign type raises :class:`~hf_dist.checkpoint.safety.errors.UnsafePickleError` unless ``trust_pickles``).
    A malformed manifest makes a checkpoint "not complete", with the reason in the log.

    Rank 0 prints one line (``announce=False``: the caller says it, as the recipes do with :func:`resume_line`):
    ``[hf_dist] resuming from out/checkpoint-500 at step 500``, or why the run starts from scratch
    (``[hf_dist] no checkpoint-N folder in out: starting from scratch``).
    """
    _check_output_dir(output_dir)
    check_output_dir_free(output_dir)  # never resume from a folder another live job is writing
    live_world = _live_world_size(world_size, training_args, strategy)
    found, skipped = _newest_resumable(output_dir, live_world, trust_pickles)
    if found is not None:
        found = _prepare(found, strategy, world_size, training_args, trust_pickles)
    elif skipped and not fresh_start:
        _refuse_unproven(output_dir, skipped)
    if announce:
        line = resume_line(found) if found is not None else _fresh_line(output_dir, len(skipped))
        _say(line, training_args or getattr(strategy, "args", None))
    return found


def _newest_resumable(output_dir: Any, live_world: int, trust_pickles: bool) -> tuple[str | None, list[str]]:
    """(the newest checkpoint that can be resumed, or None; a line per newer one skipped, with its reasons)."""
    journal = runs.read_run(output_dir)
    skipped = []
    for step, path in list_checkpoints(output_dir):
        reasons = _not_resumable(path, step, live_world, journal) or _unloadable(path, trust_pickles)
        if not reasons:
            return path, skipped
        logger.warning("auto_resume: skipping %s: %s", path, "; ".join(reasons))
        skipped.append(f"  {Path(path).name}: {'; '.join(reasons)}")
    return None, skipped


def resume_line(found: str | os.PathLike | None, training_args: Any = None, *, output_dir: Any = None) -> str:
    """The one line a run says about what it resumes (:func:`auto_resume`, the recipes' ``--resume_from_checkpoint``):
    ``found`` and its step; with ``training_args``, that there is nothing to train when ``found`` is at the run's
    last step (:func:`~hf_dist.checkpoint.lifecycle.finished.finished_message`); ``found`` None: why ``output_dir``
    starts from scratch."""
    if found is None:
        return _fresh_line(output_dir, 0)
    finished = finished_at(found, training_args) if training_args is not None else None
    if finished:
        return finished_message(*finished, found)
    return f"[hf_dist] resuming from {found} at step {_step_of(Path(found))}"


def _fresh_line(output_dir: str | os.PathLike, unproven: int) -> str:
    """Why a run starts from step 0: no checkpoint at all, or (``fresh_start=True``) none that is complete."""
    if unproven:
        why = f"none of the {unproven} checkpoint(s) in {output_dir} can be proven complete and fresh_start=True"
    elif not Path(output_dir).exists():
        why = f"{output_dir} does not exist yet"
    else:
        why = f"no checkpoint-N folder in {output_dir}"
    return f"[hf_dist] {why}: starting from scratch"


def _step_of(checkpoint: Path) -> int | str:
    """The step a checkpoint was saved at: its ``trainer_state.json``'s ``global_step``, else its folder's N."""
    step = saved_step(checkpoint)
    if step is not None:
        return step
    match = CHECKPOINT_DIR_RE.match(checkpoint.name)
    return int(match.group(1)) if match else "unknown"


def _say(line: str, training_args: Any) -> None:
    """Print ``line`` once, on rank 0 (the run's ``TrainingArguments``' ``process_index``, else the process group's
    rank or the launcher's ``RANK``), where a user sees it without logging set up."""
    rank = getattr(training_args, "process_index", None)
    if rank is None:
        from hf_dist.runtime import dist as _dist

        rank = _dist.rank() if _dist.is_distributed() else int(os.environ.get("RANK", 0))
    if rank == 0:
        print(line, flush=True)


def _unloadable(path: str, trust_pickles: bool) -> list[str]:
    """Why ``path`` cannot be loaded as its resume will load it (:func:`gate_checkpoint`, on every rank alike): a corrupt
    or crafted file (a length past the file's end, a truncated archive) is skipped, named; a planted pickle or a path
    leading out still raises."""
    try:
        gate_checkpoint(path, trust_pickles=trust_pickles)
    except CorruptCheckpointError as exc:
        return [str(exc)]
    return []


def _prepare(path: str, running: Any, world_size: int | None, training_args: Any, trust_pickles: bool) -> str:
    """The complete, loadable checkpoint ``path`` checked (and with ``training_args`` prepared) for the run about to
    resume it."""
    if training_args is not None:
        return prepare_resume(path, world_size, training_args=training_args, trust_pickles=trust_pickles, gated=True)
    if running is not None:
        name, live_world = strategy_and_world(running, world_size)
        check_resume_compatible(path, name, world_size=live_world)
    return path


def _refuse_unproven(output_dir: str | os.PathLike, skipped: list[str]) -> None:
    raise RuntimeError(
        f"auto_resume: {output_dir} holds {len(skipped)} checkpoint(s) and none can be proven complete, so "
        "resuming could load a half-written save and starting over would overwrite them:\n"
        + "\n".join(skipped)
        + "\nRe-copy a checkpoint's missing files if you have them; otherwise move or delete these folders, or "
        "pass fresh_start=True to start from step 0 in this folder."
    )


def _not_resumable(path: str, step: int, live_world: int, journal: runs.RunRecord | None) -> list[str]:
    """Why ``path`` cannot be resumed: its manifest's disagreements with the disk, or without one the layout's proof;
    and whether it belongs to the run that last trained in the folder. The folder is opened once for all of it."""
    checkpoint = open_checkpoint(path, strict=False)
    run = None
    if checkpoint.manifest.judged:
        reasons = _verified(checkpoint)
        run = checkpoint.manifest.run if not reasons else None
    else:
        reasons = proof.unproven_reasons(checkpoint, live_world)
        if not reasons:
            logger.info("auto_resume: %s has no %s (hf_dist's callbacks were not attached); proved complete from "
                        "the files its strategy writes", path, MANIFEST_NAME)  # fmt: skip
        else:
            reasons = [f"no {MANIFEST_NAME} and its files do not prove it complete: " + "; ".join(reasons)]
    lineage = runs.lineage_reason(journal, step, run)
    return reasons + ([lineage] if lineage else [])


def _verified(checkpoint: CheckpointFolder) -> list[str]:
    """The manifest's disagreements with the disk; with several ranks launched each hashes its share of the files
    and every rank gets every reason (a collective: every rank checks the same folders in the same order)."""
    from hf_dist.runtime import dist as _dist

    if not _dist.is_distributed() or _dist.world_size() < 2:
        return manifest.incomplete_reasons(checkpoint)
    mine = manifest.own_files(checkpoint.root, _dist.rank(), _dist.world_size())
    merged: list[str] = []
    for reasons in _dist.gather_objects(manifest.incomplete_reasons(checkpoint, files=mine)):
        merged += [r for r in reasons or [] if r not in merged]
    return merged


def _live_world_size(world_size: int | None, training_args: Any, running: Any) -> int:
    """The ranks of the run about to resume: given, from its TrainingArguments or Trainer, else the launcher's."""
    for source in (training_args, getattr(running, "args", None)):
        if world_size is None and source is not None:
            world_size = getattr(source, "world_size", None)
    return int(world_size or os.environ.get("WORLD_SIZE", 1))


def _check_output_dir(output_dir: str | os.PathLike) -> None:
    root = Path(output_dir)
    if is_checkpoint_dir(root):
        raise ValueError(
            f"auto_resume got {root}, which is a checkpoint folder itself.\n"
            f"  Pass the run's output_dir that holds the checkpoint-N folders: {root.parent}\n"
            f"  or pass {root} to trainer.train(resume_from_checkpoint=...) directly"
        )
