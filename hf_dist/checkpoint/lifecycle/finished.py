"""A finished run: resuming a checkpoint saved at the run's last step trains nothing.

transformers trains one step past ``max_steps`` when it resumes such a checkpoint (transformers 5.x,
``trainer.py``): ``_init_training_state`` restores ``global_step`` (say 60 of 60) and, when 60 is not a whole
number of epochs, ``_run_epoch`` skips the 60 batches already trained and enters its update loop, which runs a
forward, a backward and an optimizer step before anything compares ``global_step`` with ``max_steps``. The first
comparison is ``DefaultFlowCallback.on_step_end`` (``global_step >= max_steps``), after step 61, which the
Trainer then saves as ``checkpoint-61``. No callback event comes between the start of training and that first
step with a way to stop it: ``control.should_training_stop`` is read only after a micro-batch has run.

:func:`stop_if_finished` (asked by a Trainer given to :func:`hf_dist.callbacks.attach`) closes that gap at the one
place the loop asks for batches: while ``global_step >= max_steps`` the Trainer gets none and is told to stop, so a
resume of a finished run loads the checkpoint (weights, optimizer, scheduler, under every strategy) and trains
nothing.
:func:`finished_at` answers the same question from the files alone, before any model is built (the recipes).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.trainer_state import TrainerStateError, read_trainer_state


def last_step(training_args: Any, state: dict[str, Any]) -> int | None:
    """The step a run of ``training_args`` ends at, given a checkpoint's ``trainer_state.json`` (``state``):
    ``max_steps`` when it is set; for a run of ``num_train_epochs``, the ``max_steps`` the checkpoint's run computed
    for the same number of epochs; else None (unknown before the Trainer counts the batches)."""
    if int(getattr(training_args, "max_steps", -1) or -1) > 0:
        return int(training_args.max_steps)
    epochs = math.ceil(float(getattr(training_args, "num_train_epochs", 0) or 0))
    if state.get("num_train_epochs") == epochs and int(state.get("max_steps") or 0) > 0:
        return int(state["max_steps"])
    return None


def finished_at(checkpoint: str | os.PathLike | None, training_args: Any) -> tuple[int, int] | None:
    """``(the checkpoint's step, the run's last step)`` when ``checkpoint`` is at (or past) the last step of the run
    ``training_args`` describes, so resuming it has nothing to train; None otherwise (no checkpoint, no
    ``trainer_state.json``, steps left)."""
    if not checkpoint:
        return None
    try:
        state = read_trainer_state(checkpoint)
    except TrainerStateError:
        return None
    step, last = state["global_step"], last_step(training_args, state)
    return (step, last) if last is not None and step >= last else None


def finished_message(step: int, max_steps: int, checkpoint: str | os.PathLike | None = None) -> str:
    """The one line a finished run's rerun prints."""
    where = f"{Path(checkpoint).name} is at step {step}" if checkpoint else f"the resumed state is at step {step}"
    return (
        f"[hf_dist] nothing to train: {where} and max_steps is {max_steps}, so this run is finished "
        "(raise max_steps to train further)"
    )


def stop_if_finished(trainer: Any) -> bool:
    """Whether ``trainer`` is at or past ``max_steps`` (a resumed finished run): then training is told to stop and
    rank 0 prints :func:`finished_message` once. The Trainer extension asks it before every batch
    (``get_batch_samples`` returns no batch when it is True)."""
    state = trainer.state
    if not (state.max_steps and state.global_step >= state.max_steps):
        return False
    trainer.control.should_training_stop = True
    if not getattr(trainer, "_hf_dist_said_finished", False) and trainer.args.process_index == 0:
        print(finished_message(state.global_step, state.max_steps), flush=True)
    trainer._hf_dist_said_finished = True
    return True
