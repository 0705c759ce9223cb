"""The one class through which hf_dist extends the Trainer: every method it changes, each calling ``super()``.

:func:`extend` makes a Trainer's class ``(TrainerExtension, its class)``, made once per class, so TRL's trainers
and a user's subclass keep their own methods and hf_dist's run around them. :func:`hf_dist.callbacks.attach`
extends the Trainer it is given with the guards on; a watchdog or throughput callback given to
``Trainer(callbacks=[...])`` extends the Trainer it finds for the phases alone.

- ``train``: the checkpoint it resumes must be of this model
  (:func:`~hf_dist.checkpoint.lifecycle.model_config.check_resumed_model`), and while it runs the Trainer's
  DeepSpeed resume is guarded (:func:`~hf_dist.checkpoint.safety.trainer_loads.deepspeed_load_guarded`; put back
  when ``train`` returns).
- ``get_batch_samples``: no batch once a resumed run is at ``max_steps``
  (:func:`~hf_dist.checkpoint.lifecycle.finished.stop_if_finished`).
- ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``: the loads of
  a resume, confined to the checkpoint and ``weights_only``
  (:func:`~hf_dist.checkpoint.safety.trainer_loads.checkpoint_loads`).
- ``_load_callback_state`` (right after a resume read ``trainer_state.json``) and ``_load_best_model``: a
  ``best_model_checkpoint`` that is not this run's is dropped
  (:func:`~hf_dist.checkpoint.safety.trainer_loads.keep_best_only_if_this_runs`); the best model loads guarded.
- ``evaluate``, ``_save_checkpoint``, ``_load_best_model``: timed as phases (:mod:`hf_dist.callbacks.phases`), so
  the hang watchdog gives them their own allowance; ``_save_checkpoint`` is bracketed by the attached checkpoint
  callbacks (:class:`~hf_dist.callbacks.resume.CompleteCheckpointCallback`: the old manifest goes before a file is
  written).

``tests/unit/test_trainer_contract.py`` names the method and the transformers version when a release renames one of
these or changes the parameters they pass on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from hf_dist.callbacks.phases import Phase, phase
from hf_dist.checkpoint.lifecycle.finished import stop_if_finished
from hf_dist.checkpoint.lifecycle.model_config import check_resumed_model
from hf_dist.checkpoint.safety import trainer_loads
from hf_dist.checkpoint.safety.trainer_loads import checkpoint_loads, keep_best_only_if_this_runs


class TrainerExtension:
    """Mixed in before a Trainer's class by :func:`extend`; see the module docstring for what each method adds."""

    _hf_dist_guards = False  # attach() turns them on; a callback alone extends the Trainer for the phases

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        with self._hf_dist_resume(resume_from_checkpoint):
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any, *args: Any, **kwargs: Any) -> Any:
        if self._hf_dist_guards and stop_if_finished(self):
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        with self._hf_dist_loads(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        with self._hf_dist_loads(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint, *args, **kwargs)

    def _load_scaler(self, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        with self._hf_dist_loads(checkpoint):
            return super()._load_scaler(checkpoint, *args, **kwargs)

    def _load_rng_state(self, checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
        with self._hf_dist_loads(checkpoint):
            return super()._load_rng_state(checkpoint, *args, **kwargs)

    def _load_callback_state(self, *args: Any, **kwargs: Any) -> Any:
        if self._hf_dist_guards:
            keep_best_only_if_this_runs(self)
        return super()._load_callback_state(*args, **kwargs)

    def _load_best_model(self, *args: Any, **kwargs: Any) -> Any:
        with phase(Phase.LOAD):
            if self._hf_dist_guards and not keep_best_only_if_this_runs(self):
                return None
            with self._hf_dist_loads(self.state.best_model_checkpoint):
                return super()._load_best_model(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with phase(Phase.EVALUATE):
            return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
        parent = super()._save_checkpoint
        save = functools.partial(parent, *args, **kwargs) if args or kwargs else parent
        for bracket in reversed(self._hf_dist_save_brackets()):  # the first registered is the outermost
            save = functools.partial(bracket.bracketed_save, save)
        with phase(Phase.SAVE):
            return save(model, trial)

    # ---- helpers (one prefix, so no Trainer attribute is shadowed)

    def _hf_dist_loads(self, checkpoint: Any) -> contextlib.AbstractContextManager:
        return checkpoint_loads(checkpoint) if self._hf_dist_guards else contextlib.nullcontext()

    @contextlib.contextmanager
    def _hf_dist_resume(self, resume_from_checkpoint: Any) -> Iterator[None]:
        if not self._hf_dist_guards:
            yield
            return
        check_resumed_model(self, resume_from_checkpoint)
        with trainer_loads.deepspeed_load_guarded():
            yield

    def _hf_dist_save_brackets(self) -> list[Any]:
        """The callbacks that bracket this Trainer's saves: those attach gave this Trainer."""
        callbacks = self.callback_handler.callbacks
        return [c for c in callbacks if hasattr(c, "bracketed_save") and getattr(c, "trainer", None) is self]


# the Trainer methods hf_dist extends
EXTENDED = tuple(name for name in vars(TrainerExtension) if not name.startswith(("__", "_hf_dist")))

_CLASSES: dict[type, type] = {}


def extend(trainer: Any, *, guards: bool = False) -> Any:
    """Make ``trainer`` an instance of its class extended by :class:`TrainerExtension` (once; ``guards``: turn the
    checkpoint guards on, as :func:`hf_dist.callbacks.attach` does). ``None`` is returned as it is. A class without
    one of :data:`EXTENDED` is refused, naming the class, the methods it lacks and the installed transformers."""
    if trainer is None:
        return None
    if not isinstance(trainer, TrainerExtension):
        trainer.__class__ = extended_class(type(trainer))
    if guards:
        trainer_loads.check_deepspeed_load()  # refused at attach, not at the first DeepSpeed resume
        trainer._hf_dist_guards = True
    return trainer


def extended_class(cls: type) -> type:
    """``(TrainerExtension, cls)``, made once per class and named as ``cls``."""
    if cls not in _CLASSES:
        lacking = [name for name in EXTENDED if not callable(getattr(cls, name, None))]
        if lacking:
            import transformers

            raise RuntimeError(
                f"cannot extend {cls.__qualname__}: it has no {', '.join(lacking)}, which hf_dist extends (a "
                f"transformers.Trainer has them); pass a Trainer or a subclass of it, with a transformers version "
                f"hf_dist tests (installed: {transformers.__version__}; `hf-dist env` lists them)"
            )
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        _CLASSES[cls] = type(cls.__name__, (TrainerExtension, cls), namespace)
    return _CLASSES[cls]
