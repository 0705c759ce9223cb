"""Trainer callbacks that watch a run; each does one thing, with side effects on rank 0 only.

    from hf_dist.callbacks import attach
    resume = hf_dist.auto_resume(args.output_dir, training_args=args)  # newest complete checkpoint, resharded
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    attach(trainer)                     # checks the run against the plan hf_dist.auto_args made (or plan=...)
    trainer.train(resume_from_checkpoint=resume)

``Trainer(callbacks=default(plan))`` works too, but the Trainer calls user callbacks after its
``report_to`` integrations, so the ``memory/*`` and ``perf/*`` keys then reach only
``trainer.state.log_history``; ``attach`` puts them before the integrations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import TrainerCallback

_NAMES = {
    "PlanCallback": "hf_dist.callbacks.plan",
    "MemoryCallback": "hf_dist.callbacks.memory",
    "ThroughputCallback": "hf_dist.callbacks.throughput",
    "HangWatchdogCallback": "hf_dist.callbacks.watchdog",
    "NanGuardCallback": "hf_dist.callbacks.nan_guard",
    "ExportCallback": "hf_dist.callbacks.export",
    "ProfilerCallback": "hf_dist.callbacks.profiler",
    "AsyncCheckpointCallback": "hf_dist.callbacks.resume",
    "CompleteCheckpointCallback": "hf_dist.callbacks.resume",
    "ShardedResumeCallback": "hf_dist.callbacks.resume",
    "ZeroInfinityResumeCallback": "hf_dist.callbacks.resume",
    "auto_resume": "hf_dist.checkpoint.lifecycle.auto_resume",
    "is_complete": "hf_dist.checkpoint.lifecycle.manifest",
}

__all__ = sorted(_NAMES) + ["attach", "default"]


def __getattr__(name: str) -> Any:
    # Lazy: importing transformers' Trainer machinery costs seconds.
    import importlib

    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_dist.callbacks' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def default(plan: Any = None, *, resume_from: str | None = None, async_save: bool = False) -> list[TrainerCallback]:
    """The recommended set: complete-checkpoint markers, NaN guard, throughput, memory, the plan when given,
    the optimizer checkpoint of models sharded at load (TP; :class:`~hf_dist.callbacks.resume.ShardedResumeCallback`,
    before the markers) and the repairs DeepSpeed's universal-checkpoint loads
    (:func:`hf_dist.checkpoint.lifecycle.reshard.reshard_callback`) and ZeRO-Infinity resumes
    (:class:`~hf_dist.callbacks.resume.ZeroInfinityResumeCallback`) need.

    Export and profiling cost disk and time, so they are opt-in (``ExportCallback``, ``ProfilerCallback``).
    ``resume_from``: the checkpoint ``trainer.train(resume_from_checkpoint=...)`` resumes, when it is not in the run's
    ``output_dir`` (the optimizer state of a model sharded at load is read from there). ``async_save``: checkpoints
    written in the background (:class:`~hf_dist.callbacks.resume.AsyncCheckpointCallback` instead of
    ``CompleteCheckpointCallback``; it needs :func:`attach`).
    """
    from hf_dist.callbacks.memory import MemoryCallback
    from hf_dist.callbacks.nan_guard import NanGuardCallback
    from hf_dist.callbacks.plan import PlanCallback
    from hf_dist.callbacks.resume import (
        AsyncCheckpointCallback,
        CompleteCheckpointCallback,
        ShardedResumeCallback,
        ZeroInfinityResumeCallback,
    )
    from hf_dist.callbacks.throughput import ThroughputCallback
    from hf_dist.callbacks.watchdog import HangWatchdogCallback
    from hf_dist.checkpoint.lifecycle.reshard import reshard_callback

    callbacks: list[TrainerCallback] = [PlanCallback(plan)] if plan is not None else []
    callbacks += [
        ShardedResumeCallback(resume_from=resume_from),
        ZeroInfinityResumeCallback(resume_from=resume_from),
        AsyncCheckpointCallback() if async_save else CompleteCheckpointCallback(),
        NanGuardCallback(),
        ThroughputCallback(plan),
        MemoryCallback(plan),
        HangWatchdogCallback(),
    ]
    callbacks.append(reshard_callback())
    return callbacks


def attach(
    trainer: Any,
    callbacks: list[TrainerCallback] | None = None,
    *,
    plan: Any = None,
    resume_from: str | None = None,
    async_save: bool = False,
) -> list[TrainerCallback]:
    """Insert ``callbacks`` (default: ``default(plan, resume_from=..., async_save=...)``) right after the Trainer's
    flow callback.

    Refuses at once a launch of several ranks that the Trainer trains as separate one-process copies
    (:func:`hf_dist.callbacks.plan.check_launch`), and a second job writing the same output folder
    (:func:`hf_dist.checkpoint.output.lock.claim_output_dir`: every rank raises ``OutputBusyError`` naming
    the job that holds it; a rank whose launcher dies stops), and ranks whose trainable parameters differ where the
    engine would train a mix of them (:func:`hf_dist.runtime.replicas.check_replicas_agree`: FSDP2 without
    ``cpu_ram_efficient_loading``, the one engine that does not broadcast rank 0's copy; seed before creating the
    adapter).

    Extends the Trainer's class with :class:`hf_dist.callbacks.extension.TrainerExtension` (every method hf_dist
    changes, each calling ``super()``): while a resume or the best model loads, every unpickle the Trainer,
    accelerate or DeepSpeed makes is torch's ``weights_only`` load with hf_dist's allowlist, and every file must lie
    inside the checkpoint; the resume of a finished run (a checkpoint at ``max_steps``) trains nothing, where the
    Trainer would train one step past it; the resume of a checkpoint whose ``config.json`` is of another model is
    refused before anything is built or loaded.

    ``plan``: the run is checked against it at train start (:class:`~hf_dist.callbacks.plan.PlanCallback`: world size,
    strategy, precision, checkpointing, batch split, tp/cp/sp, FSDP wrap classes, the optimizer that steps, TRL's
    ``max_length``), and a difference stops it before its first step; the memory and throughput callbacks report
    against its predictions. ``None`` (the default): the plan :func:`hf_dist.auto_args` put into the arguments
    ``trainer.args`` was built from (:mod:`hf_dist.runtime.planned`), if any; ``False``: no plan.

    There they run before the ``report_to`` integrations and the console printer, so the keys they
    add to the logs reach TensorBoard, W&B, etc. They get the ``on_init_end`` event they missed (the
    Trainer was built before them). Returns the inserted callbacks.
    """
    _guard(trainer)
    if callbacks is None:
        callbacks = default(_the_plan(plan, trainer), resume_from=resume_from, async_save=async_save)
    elif async_save:
        raise ValueError(
            "async_save=True chooses the default callbacks; with your own list, add AsyncCheckpointCallback()"
        )
    else:
        callbacks = list(callbacks)
    _insert(trainer, callbacks)
    return callbacks


def _guard(trainer: Any) -> None:
    """What :func:`attach` checks and guards before any callback is inserted, in this order."""
    from hf_dist.callbacks.extension import extend
    from hf_dist.callbacks.plan import check_launch
    from hf_dist.checkpoint.output.lock import claim_output_dir
    from hf_dist.runtime.replicas import check_replicas_agree

    check_launch(trainer.args)  # several ranks launched, each training alone: refused before anything else
    check_replicas_agree(trainer.model)  # ranks holding different trainable parameters, before FSDP2 mixes them
    claim_output_dir(trainer.args.output_dir)  # one live job per output folder; ranks stop with their launcher
    # the checkpoint loads of a resume (weights_only, confined), a finished run, a checkpoint of another model
    extend(trainer, guards=True)
    if getattr(trainer, "is_deepspeed_enabled", False):
        from hf_dist.runtime.library_warnings import quiet_deprecated_collectives

        quiet_deprecated_collectives()  # torch's deprecation of DeepSpeed's collectives: once, not at every step


def _insert(trainer: Any, callbacks: list[TrainerCallback]) -> None:
    """``callbacks`` right after the Trainer's flow callback, each given the ``on_init_end`` event it missed."""
    from transformers.trainer_callback import DefaultFlowCallback

    handler = trainer.callback_handler.callbacks
    flow = [i for i, cb in enumerate(handler) if isinstance(cb, DefaultFlowCallback)]
    position = flow[-1] + 1 if flow else 0
    handler[position:position] = callbacks
    for callback in callbacks:
        if hasattr(callback, "trainer") and callback.trainer is None:  # Throughput, AsyncCheckpoint: need the trainer
            callback.trainer = trainer
        callback.on_init_end(trainer.args, trainer.state, trainer.control, model=trainer.model)


def _the_plan(plan: Any, trainer: Any) -> Any:
    """``plan`` as given; None: the plan ``auto_args`` put into ``trainer.args`` (or None); False: None."""
    if plan is False:
        return None
    if plan is None:
        from hf_dist.runtime.planned import carried_plan

        return carried_plan(trainer.args)
    return plan
