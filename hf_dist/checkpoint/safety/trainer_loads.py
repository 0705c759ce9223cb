"""The Trainer's checkpoint loads, each run under :func:`~hf_dist.checkpoint.safety.loading.guarded_loads`.

A resume makes the Trainer, accelerate and DeepSpeed load a checkpoint folder: the Trainer's weights, optimizer,
scheduler, scaler and RNG files (``torch.load(weights_only=True)``, no path check), accelerate's FSDP model and
optimizer (DCP: ``.metadata`` with ``pickle.load``, non-tensor values with ``torch.load(weights_only=False)``) and
DeepSpeed's ``load_checkpoint`` (``torch.load(weights_only=False)`` of whatever ``latest`` names). The Trainer
extension (:class:`hf_dist.callbacks.extension.TrainerExtension`, applied by :func:`hf_dist.callbacks.attach`) runs
each of those entry points inside :func:`checkpoint_loads`: every load is torch's ``weights_only`` load with
hf_dist's allowlist and confined to the checkpoint it was given, and a checkpoint with a manifest is read only when
it matches it (:func:`hf_dist.checkpoint.lifecycle.manifest.require_match`). The DeepSpeed load is a module
function of ``transformers.trainer``: :func:`deepspeed_load_guarded` replaces it only while ``train()`` runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.safety.loading import active_root, guarded_loads
from hf_dist.checkpoint.safety.paths import ConfinedFolder

DEEPSPEED_LOAD = "deepspeed_load_checkpoint"  # transformers.trainer's function that resumes a DeepSpeed engine


def keep_best_only_if_this_runs(trainer: Any) -> bool:
    """Whether ``state.best_model_checkpoint`` may stand: None, or a ``checkpoint-N`` of this run's ``output_dir``
    whose manifest matches (:func:`best_checkpoint_problem`). Otherwise it is dropped with one warning
    (``state.best_model_checkpoint = None``): the Trainer keeps the weights it trained, and neither its checkpoint
    rotation nor its end-of-training deletions (``save_total_limit=1`` removes every checkpoint that is not the best)
    nor an export name it.

    Called as soon as a resume has read ``trainer_state.json`` (a planted best would otherwise be saved into every
    later checkpoint's state), and before the best model loads."""
    best = trainer.state.best_model_checkpoint
    if not best:
        return True
    reason = best_checkpoint_problem(best, trainer.args.output_dir)
    if reason is None:
        _VERIFIED.add(_verified_key(Path(best)))  # just matched: the guarded load does not hash it a second time
        return True
    import logging

    logging.getLogger("hf_dist").warning(
        "dropping trainer_state.json's best_model_checkpoint %s: %s; the final model is the one trained, and no "
        "checkpoint is kept or deleted for it", best, reason,
    )  # fmt: skip
    trainer.state.best_model_checkpoint = None
    return False


def best_checkpoint_problem(best: Any, output_dir: Any) -> str | None:
    """Why ``best`` (a ``best_model_checkpoint``) is not a ``checkpoint-N`` of ``output_dir`` whose manifest matches
    the disk; None when it is. Links are resolved by the OS: a ``checkpoint-N`` linked elsewhere is not this run's."""
    import os
    import re

    from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint
    from hf_dist.checkpoint.formats.names import MANIFEST_NAME
    from hf_dist.checkpoint.lifecycle.manifest import incomplete_reasons

    if not isinstance(best, (str, os.PathLike)):
        return f"it is {type(best).__name__}, not a folder name"
    name = os.path.basename(os.path.normpath(os.fspath(best)))
    real = os.path.realpath(best)  # compared, never joined: the name is read from a file
    in_output_dir = os.path.dirname(real) == os.path.realpath(os.fspath(output_dir)) and os.path.basename(real) == name
    if not re.fullmatch(r"checkpoint-[0-9]+", name) or not in_output_dir:
        return f"it is not a checkpoint-N folder of this run's output_dir {output_dir}"
    checkpoint = open_checkpoint(best, strict=False)
    if not checkpoint.manifest.present:
        return f"it has no {MANIFEST_NAME}, so its weights cannot be shown to be the ones this run saved"
    reasons = incomplete_reasons(checkpoint)
    if reasons:
        return f"it does not match its {MANIFEST_NAME} ({'; '.join(reasons[:2])})"
    return None


_VERIFIED: set[tuple[str, float]] = set()  # (checkpoint, its manifest's mtime) matched against the disk


@contextlib.contextmanager
def checkpoint_loads(checkpoint: Any) -> Iterator[None]:
    """The block's loads guarded for ``checkpoint`` (a checkpoint with a manifest must match it first, once per
    checkpoint and manifest: the later loads of a resume read the verified files). No checkpoint, or inside another
    guarded load: the block runs as it is."""
    if not checkpoint or active_root() is not None:
        yield
        return
    _verify_once(Path(checkpoint))
    with guarded_loads(checkpoint):
        yield


def _verify_once(checkpoint: Path) -> None:
    from hf_dist.checkpoint.lifecycle.manifest import require_match

    key = _verified_key(checkpoint)
    if key not in _VERIFIED:
        require_match(checkpoint)
        _VERIFIED.add(key)


def _verified_key(checkpoint: Path) -> tuple[str, float]:
    from hf_dist.checkpoint.formats.names import MANIFEST_NAME

    manifest = ConfinedFolder(checkpoint).path(MANIFEST_NAME)
    return (str(checkpoint), manifest.stat().st_mtime if manifest.is_file() else 0.0)


@contextlib.contextmanager
def deepspeed_load_guarded() -> Iterator[None]:
    """While the block runs, ``transformers.trainer.deepspeed_load_checkpoint(engine, path)`` (the Trainer's
    DeepSpeed resume, called from its training loop) loads ``path`` under :func:`checkpoint_loads` and then repairs a
    ZeRO-Infinity optimizer; the library's own function is put back when the block ends, however it ends."""
    import transformers.trainer as trainer_module

    load = check_deepspeed_load()
    if getattr(load, "_hf_dist_guarded", False):  # a train() inside a train()
        yield
        return

    @functools.wraps(load)
    def guarded(engine: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint = args[0] if args else kwargs.get("checkpoint_path")
        with checkpoint_loads(checkpoint):
            result = load(engine, *args, **kwargs)
            _repair_zero_infinity(engine, checkpoint)
        return result

    guarded._hf_dist_guarded = True
    setattr(trainer_module, DEEPSPEED_LOAD, guarded)
    try:
        yield
    finally:
        setattr(trainer_module, DEEPSPEED_LOAD, load)


def check_deepspeed_load() -> Any:
    """``transformers.trainer.deepspeed_load_checkpoint``; refused, naming the installed transformers, without it."""
    import transformers.trainer as trainer_module

    load = getattr(trainer_module, DEEPSPEED_LOAD, None)
    if not callable(load):
        raise RuntimeError(_missing(f"transformers.trainer.{DEEPSPEED_LOAD}"))
    return load


def _repair_zero_infinity(engine: Any, checkpoint: Any) -> None:
    """A ZeRO-Infinity resume (optimizer swapped to NVMe): DeepSpeed's load never opens the ``*_optim_states.pt``
    files (it copies only the swap files back), so they would go unread, planted or not, and the optimizer state they
    hold lost. They are read here, still under the guard, by hf_dist's repair
    (:func:`hf_dist.checkpoint.lifecycle.zero_infinity.restore_resident_subgroups`)."""
    from hf_dist.checkpoint.lifecycle.zero_infinity import restore_resident_subgroups, zero_infinity_optimizer

    optimizer = zero_infinity_optimizer(getattr(engine, "optimizer", None))
    if optimizer is not None and checkpoint:
        restore_resident_subgroups(optimizer, checkpoint)


def _missing(what: str) -> str:
    import transformers

    return (
        f"transformers {transformers.__version__} has no {what}, through which hf_dist guards the Trainer's "
        "checkpoint loads (weights_only, paths confined); install a transformers version hf_dist tests "
        "(`hf-dist env` lists them)"
    )
