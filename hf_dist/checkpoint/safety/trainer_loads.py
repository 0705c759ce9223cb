"""The Trainer's checkpoint loads, each run under :func:`~hf_dist.checkpoint.safety.loading.guarded_loads`.

A resume makes the Trainer, accelerate and DeepSpeed load a checkpoint folder: the Trainer's weights, optimizer,
scheduler, scaler and RNG files (``torch.load(weights_only=True)``, no path check), accelerate's FSDP model and
optimizer (DCP: ``.metadata`` with ``pickle.load``, non-tensor values with ``torch.load(weights_only=False)``) and
DeepSpeed's ``load_checkpoint`` (``torch.load(weights_only=False)`` of whatever ``latest`` names). Each of those
entry points is wrapped so that, while it runs, every load is torch's ``weights_only`` load with hf_dist's
allowlist and confined to the checkpoint it was given, and a checkpoint with a manifest is read only when it
matches it (:func:`hf_dist.checkpoint.lifecycle.manifest.require_match`); :func:`hf_dist.callbacks.attach` calls
:func:`guard_trainer`. The methods wrapped are the Trainer's own names (transformers 5.x); a Trainer without one
of them is refused rather than left half-guarded.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.safety.loading import active_root, guarded_loads

# Trainer methods that load from the checkpoint path they are given (the best model: from the state's best path)
TRAINER_LOADS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")
BEST_MODEL_LOAD = "_load_best_model"


def guard_trainer(trainer: Any) -> None:
    """Wrap ``trainer``'s checkpoint loads (and, once per process, the Trainer's DeepSpeed load) in guarded loads."""
    if getattr(trainer, "_hf_dist_loads_guarded", False):
        return
    for name in (*TRAINER_LOADS, BEST_MODEL_LOAD):
        if not callable(getattr(trainer, name, None)):
            raise RuntimeError(_missing(f"Trainer.{name}"))
    for name in TRAINER_LOADS:
        setattr(trainer, name, _guarded(getattr(trainer, name), lambda args, kwargs: _first(args, kwargs)))
    best = _guarded(getattr(trainer, BEST_MODEL_LOAD), lambda args, kwargs: trainer.state.best_model_checkpoint)
    setattr(trainer, BEST_MODEL_LOAD, _only_this_runs_best(trainer, best))
    resumed = getattr(trainer, RESUMED_STATE_HOOK, None)
    if callable(resumed):  # transformers 5: called right after a resume reads trainer_state.json
        setattr(trainer, RESUMED_STATE_HOOK, _checking_the_resumed_best(trainer, resumed))
    _guard_deepspeed_load()
    trainer._hf_dist_loads_guarded = True


# The Trainer method called right after a resume has read trainer_state.json into trainer.state
RESUMED_STATE_HOOK = "_load_callback_state"


def _keep_best_only_if_this_runs(trainer: Any) -> bool:
    """Whether ``state.best_model_checkpoint`` may stand: None, or a ``checkpoint-N`` of this run's ``output_dir``
    whose manifest matches (:func:`best_checkpoint_problem`). Otherwise it is dropped with one warning
    (``state.best_model_checkpoint = None``): the Trainer keeps the weights it trained, and neither its checkpoint
    rotation nor its end-of-training deletions (``save_total_limit=1`` removes every checkpoint that is not the best)
    nor an export name it."""
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


def _checking_the_resumed_best(trainer: Any, method: Any) -> Any:
    """A resume: the best checkpoint the resumed ``trainer_state.json`` names is checked as soon as it is read (a
    planted one would otherwise be saved into every later checkpoint's state, and, under ``save_total_limit=1``,
    have the Trainer delete every checkpoint of the run at its end)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        _keep_best_only_if_this_runs(trainer)
        return method(*args, **kwargs)

    return run


def _only_this_runs_best(trainer: Any, load: Any) -> Any:
    """The best-model load, run only when ``state.best_model_checkpoint`` (read from a resumed ``trainer_state.json``,
    so any path a handed folder names) still is this run's (:func:`_keep_best_only_if_this_runs`)."""

    @functools.wraps(load)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not _keep_best_only_if_this_runs(trainer):
            return None
        return load(*args, **kwargs)

    return run


def best_checkpoint_problem(best: Any, output_dir: Any) -> str | None:
    """Why ``best`` (a ``best_model_checkpoint``) is not a ``checkpoint-N`` of ``output_dir`` whose manifest matches
    the disk; None when it is. Links are resolved by the OS: a ``checkpoint-N`` linked elsewhere is not this run's."""
    import os
    import re

    from hf_dist.checkpoint.formats.names import MANIFEST_NAME
    from hf_dist.checkpoint.lifecycle.manifest import incomplete_reasons

    if not isinstance(best, (str, os.PathLike)):
        return f"it is {type(best).__name__}, not a folder name"
    name = os.path.basename(os.path.normpath(os.fspath(best)))
    real = os.path.realpath(best)  # compared, never joined: the name is read from a file
    in_output_dir = os.path.dirname(real) == os.path.realpath(os.fspath(output_dir)) and os.path.basename(real) == name
    if not re.fullmatch(r"checkpoint-[0-9]+", name) or not in_output_dir:
        return f"it is not a checkpoint-N folder of this run's output_dir {output_dir}"
    if not (Path(best) / MANIFEST_NAME).is_file():
        return f"it has no {MANIFEST_NAME}, so its weights cannot be shown to be the ones this run saved"
    reasons = incomplete_reasons(best)
    if reasons:
        return f"it does not match its {MANIFEST_NAME} ({'; '.join(reasons[:2])})"
    return None


def _first(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else next(iter(kwargs.values()), None)


_VERIFIED: set[tuple[str, float]] = set()  # (checkpoint, its manifest's mtime) matched against the disk


def _guarded(method: Any, checkpoint_of: Any) -> Any:
    """``method`` run under guarded loads of the checkpoint it reads; a checkpoint with a manifest must match it
    first (once per checkpoint and manifest: the later loads of a resume read the verified files)."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        checkpoint = checkpoint_of(args, kwargs)
        if not checkpoint or active_root() is not None:
            return method(*args, **kwargs)
        _verify_once(Path(checkpoint))
        with guarded_loads(checkpoint):
            return method(*args, **kwargs)

    return run


def _verify_once(checkpoint: Path) -> None:
    from hf_dist.checkpoint.lifecycle.manifest import require_match

    key = _verified_key(checkpoint)
    if key not in _VERIFIED:
        require_match(checkpoint)
        _VERIFIED.add(key)


def _verified_key(checkpoint: Path) -> tuple[str, float]:
    from hf_dist.checkpoint.formats.names import MANIFEST_NAME

    manifest = checkpoint / MANIFEST_NAME
    return (str(checkpoint), manifest.stat().st_mtime if manifest.is_file() else 0.0)


def _guard_deepspeed_load() -> None:
    """``transformers.trainer.deepspeed_load_checkpoint(engine, path)`` (the Trainer's DeepSpeed resume, called
    from its training loop) guarded for ``path``; installed once, it guards every Trainer of the process."""
    import transformers.trainer as trainer_module

    load = getattr(trainer_module, "deepspeed_load_checkpoint", None)
    if load is None:
        raise RuntimeError(_missing("transformers.trainer.deepspeed_load_checkpoint"))
    if getattr(load, "_hf_dist_guarded", False):
        return

    @functools.wraps(load)
    def load_and_repair(engine: Any, *args: Any, **kwargs: Any) -> Any:
        result = load(engine, *args, **kwargs)
        _repair_zero_infinity(engine, args[0] if args else kwargs.get("checkpoint_path"))
        return result

    guarded = _guarded(
        load_and_repair, lambda args, kwargs: args[1] if len(args) > 1 else kwargs.get("checkpoint_path")
    )
    guarded._hf_dist_guarded = True
    trainer_module.deepspeed_load_checkpoint = guarded


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
