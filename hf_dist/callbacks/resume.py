"""Callbacks that make a run resumable.

``CompleteCheckpointCallback``: each save is bracketed: before its first file, rank 0 removes the folder's old
manifest and notes the save under way; once every rank finished, each rank hashes the files it wrote and rank 0
writes the manifest (:mod:`hf_dist.checkpoint.lifecycle.manifest`), which is what :func:`hf_dist.auto_resume`
(:mod:`hf_dist.checkpoint.lifecycle.auto_resume`) trusts. At train start rank 0 records the run in the output
folder's journal (:mod:`hf_dist.checkpoint.output.runs`), so checkpoints another run left there are told apart.

``AsyncCheckpointCallback``: the same, with the Trainer's files written in the background; the Trainer's rotation
(``save_total_limit``), its best-model load and its end-of-training deletions wait for the pending write.

``ShardedResumeCallback``: saves and restores the optimizer and scheduler of a model sharded at load time
(tensor parallelism, FSDP2 x TP), which the Trainer cannot (:mod:`hf_dist.checkpoint.lifecycle.sharded_state`).

``ZeroInfinityResumeCallback``: restores the optimizer state that DeepSpeed's own NVMe resume drops
(:mod:`hf_dist.checkpoint.lifecycle.zero_infinity`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_dist.callbacks.extension import TrainerExtension
from hf_dist.callbacks.phases import Phase, phase
from hf_dist.checkpoint.lifecycle import manifest, model_config, sharded_state, zero_infinity
from hf_dist.checkpoint.output import runs
from hf_dist.runtime import dist as _dist

__all__ = [
    "AsyncCheckpointCallback",
    "CompleteCheckpointCallback",
    "ShardedResumeCallback",
    "ZeroInfinityResumeCallback",
]

logger = logging.getLogger(__name__)
# a log carrying these is the Trainer's end-of-training log, made just before its best-model load and deletions
_END_OF_TRAINING_KEYS = ("train_runtime", "train_loss")


class CompleteCheckpointCallback(TrainerCallback):
    """Brackets every save (see the module docstring): the manifest, written last, is what makes a checkpoint
    complete. Must be registered on every rank (as Trainer callbacks always are): it calls barriers.

    Added with :func:`hf_dist.callbacks.attach`, the Trainer's ``_save_checkpoint`` calls :meth:`bracketed_save`, so
    the old manifest goes before any save writes a file (every ``save_strategy``, ``"best"`` included); added with
    ``Trainer(callbacks=...)`` it does so at the step or epoch end that decides to save.
    """

    def __init__(self) -> None:
        self.trainer = None  # set by attach()
        self.run: str | None = None
        self.save_id: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and args.save_total_limit == 1:
            logger.warning(
                "save_total_limit=1: the Trainer deletes the previous checkpoint before the new one is complete on "
                "every rank, so a crash during a save leaves nothing to resume from; use save_total_limit >= 2"
            )
        if state.is_world_process_zero and args.should_save:
            self._record_run(args, state)

    def _record_run(self, args, state) -> None:
        self.run = manifest.new_id()
        resumed = Path(args.output_dir) / f"checkpoint-{state.global_step}" if state.global_step else None
        parent = None
        if resumed is not None:
            parent = manifest.load_manifest(resumed).run
        runs.begin_run(args.output_dir, self.run, start_step=state.global_step,
                       resumed_from=resumed.name if resumed is not None else None, parent_run=parent)  # fmt: skip

    # ---- before the save writes: the old manifest goes ----

    def bracketed_save(self, save: Any, model: Any, trial: Any) -> Any:
        """The Trainer's ``_save_checkpoint`` (``save``) bracketed: called by the Trainer extension
        (:class:`hf_dist.callbacks.extension.TrainerExtension`) of the Trainer attach gave this callback."""
        trainer = self.trainer
        self.begin(trainer.args, trainer.state, Path(trainer._get_output_dir(trial)), trainer.model)
        return self._save(save, model, trial)

    @property
    def _brackets_saves(self) -> bool:
        """Whether the Trainer calls :meth:`bracketed_save` (attach); else the step or epoch end that decides to save
        brackets it."""
        return isinstance(self.trainer, TrainerExtension)

    def _save(self, save: Any, model: Any, trial: Any) -> Any:
        return save(model, trial)

    def begin(self, args, state, run_dir: Path, model: Any = None) -> None:
        """Collective: rank 0 removes ``checkpoint-<step>``'s old manifest and notes the save, before any rank writes;
        under FSDP2 it writes the model's ``config.json`` there too (its DCP save has none), for ``hf-dist convert``."""
        step = state.global_step
        self.save_id = manifest.new_id()
        if state.is_world_process_zero and args.should_save:
            folder = run_dir / f"checkpoint-{step}"
            folder.mkdir(parents=True, exist_ok=True)
            manifest.begin_save(folder, step=step, run=self.run, save=self.save_id)
            if _fsdp(args):
                model_config.write_model_config(folder, model)
        _dist.barrier()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if control.should_save and not self._brackets_saves:  # without attach: the save this step end decided on
            self.begin(args, state, Path(args.output_dir), model)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        if control.should_save and not self._brackets_saves:
            self.begin(args, state, Path(args.output_dir), model)

    # ---- after every rank wrote: the manifest ----

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        _dist.barrier()  # on_save runs after _save_checkpoint returned on this rank: now on every rank
        hashed = (
            manifest.entries(folder, manifest.own_files(folder, _dist.rank(), _world(args))) if folder.is_dir() else {}
        )
        self.mark(args, state, state.global_step, hashed)

    def mark(self, args, state, step: int, hashed: dict) -> None:
        """Collective: every rank's hashes gathered; rank 0 writes ``checkpoint-<step>``'s manifest."""
        with phase(Phase.SAVE):  # the gather waits for the slowest rank's save
            self._mark(args, state, step, hashed)

    def _mark(self, args, state, step: int, hashed: dict) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{step}"
        gathered: dict = {}
        for part in _dist.gather_objects(hashed):
            gathered.update(part or {})
        if state.is_world_process_zero and checkpoint.is_dir():
            try:
                manifest.write_manifest(checkpoint, hashed=gathered, world_size=_world(args), step=step,
                                        run=self.run, save=self.save_id, strategy=_dist.live_strategy(args))  # fmt: skip
            except RuntimeError as exc:
                logger.error("%s", exc)
        # Later callbacks (export) and the next save must see the manifest.
        _dist.barrier()


def _fsdp(args) -> bool:
    from hf_dist.planning.layout import Engine, strategy

    return strategy(_dist.live_strategy(args)).engine is Engine.FSDP2


def _world(args) -> int:
    return max(_dist.world_size(), args.world_size)


class AsyncCheckpointCallback(CompleteCheckpointCallback):
    """Checkpoints that don't stall training: the Trainer's save stages its state to host memory and returns; a
    thread writes ``checkpoint-N/`` in the Trainer's own layout (:mod:`hf_dist.checkpoint.lifecycle.async_save` says what is
    written in the background and what is not), then hashes what this rank wrote. Replaces
    :class:`CompleteCheckpointCallback` (``attach(trainer, async_save=True)``): the manifest is written only once
    every rank's background writes finished, so a job killed during them resumes from the checkpoint before.

    Each step end asks every rank whether its writes ended (one small all-gather, only while a save is under way);
    the next save, the Trainer's checkpoint rotation (``save_total_limit``), the end of training (before the
    best-model load and the Trainer's last deletions) wait for them. A failed write raises :class:`AsyncSaveError`
    on every rank and leaves the checkpoint without a manifest. DeepSpeed writes its checkpoint itself: there the
    saves stay synchronous, said once. Before training, the staging copy (this rank's weights and optimizer state)
    is checked against each node's available host memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.writer = None
        self.pending_step: int | None = None
        self.stalls: list[float] = []  # seconds each save held the training thread
        self.written_s: list[float] = []  # seconds from each save's start until its manifest was written
        self.staged_bytes = 0  # the largest staging copy of this rank so far
        self._save_start = 0.0
        self._hashes = None  # the writer thread's hashes of this rank's files of the pending save
        self._rotations: list[Any] = []  # the Trainer's rotations held until the pending write ends

    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "AsyncCheckpointCallback wraps the Trainer's save, so it needs the trainer: add it with "
                "hf_dist.callbacks.attach(trainer, async_save=True) instead of Trainer(callbacks=[...])"
            )

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from hf_dist.checkpoint.lifecycle.async_save import BackgroundWriter, check_staging_fits
        from hf_dist.planning.layout import strategy

        super().on_train_begin(args, state, control, **kwargs)
        if strategy(_dist.live_strategy(args)).is_deepspeed:
            if state.is_world_process_zero:
                logger.warning(
                    "hf_dist: async_save does not apply to DeepSpeed (its engine writes the checkpoint itself, "
                    "engine.save_checkpoint): checkpoints are saved synchronously"
                )
            return
        check_staging_fits(model, optimizer, writes_weights=args.should_save)
        if self.writer is None:
            self.writer = BackgroundWriter()

    @contextlib.contextmanager
    def _rotation_held(self) -> Iterator[None]:
        """While the Trainer's save runs, its checkpoint rotation (``save_total_limit``: the module function
        ``transformers.trainer.rotate_checkpoints`` in newer transformers, ``Trainer._rotate_checkpoints`` in older
        ones) is recorded, not run: deleting now could leave no complete checkpoint on disk. :meth:`finish` runs it
        once the pending save has its manifest."""
        import transformers.trainer as trainer_module

        targets = [(trainer_module, "rotate_checkpoints"), (self.trainer, "_rotate_checkpoints")]
        saved = [(owner, name, getattr(owner, name)) for owner, name in targets if hasattr(owner, name)]
        for owner, name, rotate in saved:
            setattr(owner, name, functools.partial(self._hold_rotation, rotate))
        try:
            yield
        finally:
            for owner, name, rotate in saved:
                if owner is self.trainer:
                    delattr(owner, name)  # back to the class's method
                else:
                    setattr(owner, name, rotate)

    def _hold_rotation(self, rotate: Any, *args: Any, **kwargs: Any) -> None:
        self._rotations.append(functools.partial(rotate, *args, **kwargs))

    def _save(self, save: Any, model: Any, trial: Any) -> Any:
        if self.writer is None:  # DeepSpeed, or outside train(): the Trainer's own save
            return save(model, trial)
        trainer = self.trainer
        with phase(Phase.SAVE):  # the wait for the previous save's writes, then the staging
            self.finish(trainer.args, trainer.state, block=True)  # the staging buffers are reused
            start = time.perf_counter()
            folder = Path(trainer._get_output_dir(trial)) / f"checkpoint-{trainer.state.global_step}"
            with self.writer.intercept(), self._rotation_held():
                save(model, trial)
        self._hashes = self.writer.after_writes(
            lambda: manifest.entries(folder, manifest.own_files(folder, _dist.rank(), _world(trainer.args)))
        )
        self.stalls.append(time.perf_counter() - start)
        self.staged_bytes = max(self.staged_bytes, self.writer.staged_bytes)
        self.pending_step, self._save_start = trainer.state.global_step, start
        return None

    def on_save(self, args, state, control, **kwargs):
        if self.writer is None:  # DeepSpeed: synchronous
            super().on_save(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending_step is not None:
            self.finish(args, state, block=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and any(key in logs for key in _END_OF_TRAINING_KEYS) and self.pending_step is not None:
            with phase(Phase.SAVE):  # before the Trainer loads the best model or deletes checkpoints
                self.finish(args, state, block=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            with phase(Phase.SAVE):  # the last save's background writes
                self.finish(args, state, block=True)
            self.writer.close()
            self.writer = None

    def finish(self, args, state, *, block: bool) -> None:
        """Collective: if every rank's writes of the pending save ended, check them, write the manifest, and run the
        rotations the Trainer asked for meanwhile."""
        if self.pending_step is None:
            return
        from hf_dist.checkpoint.lifecycle.async_save import AsyncSaveError, all_ranks_done

        done, errors = all_ranks_done(self.writer, block=block)
        if not done:
            return
        step, self.pending_step = self.pending_step, None
        if errors:
            raise AsyncSaveError(
                f"the background write of checkpoint-{step} failed:\n  - " + "\n  - ".join(errors) + "\n"
                "It is left without hf_dist's manifest, so auto_resume resumes from the checkpoint before. "
                "Fix the cause (disk space, permissions) or train without async_save"
            )
        hashed = self._hashes.result() if self._hashes is not None else {}
        self.mark(args, state, step, hashed)
        self.written_s.append(time.perf_counter() - self._save_start)
        for rotate in self._rotations:
            rotate()
        self._rotations = []
        if state.is_world_process_zero:
            logger.info("hf_dist: checkpoint-%d written in the background, its manifest written", step)


class ShardedResumeCallback(TrainerCallback):
    """Checkpoint and resume the optimizer and LR scheduler of a model sharded at load time (TP, FSDP2 x TP).

    Such a model must train with ``save_only_model=True`` (the Trainer refuses more); this callback adds
    ``hf_dist_optimizer/`` (DCP), ``hf_dist_scheduler.json`` and the Trainer's own per-rank ``rng_state_R.pth``
    (which the Trainer restores itself) to each ``checkpoint-N`` and lets the Trainer's
    own weight load accept the gathered ``model.safetensors``. A resumed run (``trainer.train(
    resume_from_checkpoint=...)``) gets them back at ``on_train_begin``, resharded to its layout: the same TP
    size, FSDP2 x TP, or DDP. It must run before :class:`CompleteCheckpointCallback` (as in
    :func:`hf_dist.callbacks.default`), so the marker lists its files.

    ``resume_from``: the checkpoint being resumed when it is not ``output_dir/checkpoint-<global step>``.
    A resumed model sharded at load whose checkpoint has no optimizer state raises: Adam would silently
    restart from zero moments. The optimizer folder passes hf_dist's loading gate before DCP unpickles it
    (``trust_pickles=True`` skips it).
    """

    def __init__(self, *, resume_from: str | None = None, trust_pickles: bool = False) -> None:
        self.resume_from = resume_from
        self.trust_pickles = trust_pickles
        self.sharded_at_load = False

    def on_init_end(self, args, state, control, model=None, **kwargs):
        # attach() replays this event for callbacks added after the Trainer was built
        self.sharded_at_load = model is not None and sharded_state.has_dtensor_params(model)
        if self.sharded_at_load:
            sharded_state.accept_full_state_dict(model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step == 0:  # a fresh run: the Trainer loaded no trainer_state.json
            return
        checkpoint = Path(self.resume_from or Path(args.output_dir) / f"checkpoint-{state.global_step}")
        if sharded_state.has_optimizer_state(checkpoint):
            sharded_state.load_optimizer_state(
                checkpoint, model, optimizer, lr_scheduler, trust_pickles=self.trust_pickles
            )
            if state.is_world_process_zero:
                logger.info("resumed the optimizer and scheduler of step %d from %s", state.global_step, checkpoint)
        elif self.sharded_at_load:
            raise RuntimeError(
                f"resuming a model sharded at load time at step {state.global_step}, but {checkpoint} holds no "
                f"optimizer state ({sharded_state.OPTIMIZER_DIR}/): Adam would restart from zero moments. Resume "
                "from a checkpoint saved with hf_dist's callbacks, or pass ShardedResumeCallback(resume_from=PATH) "
                "when the checkpoint is not in output_dir"
            )

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.sharded_at_load:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            with phase(Phase.SAVE):
                sharded_state.save_optimizer_state(checkpoint, model, optimizer, lr_scheduler)
                if args.save_only_model:  # the Trainer left its RNG files out; it reads them back on resume itself
                    sharded_state.save_rng_state(checkpoint, args.world_size)


class ZeroInfinityResumeCallback(TrainerCallback):
    """On resume of a ZeRO-Infinity run (ZeRO-3, optimizer offloaded to NVMe), restore what DeepSpeed's NVMe load
    drops: it copies only the swap files back, so the sub-groups it keeps in memory (under 1 MiB per rank, e.g. the
    norms) would restart from the initial weights, and every Adam moment and step count from zero
    (:mod:`hf_dist.checkpoint.lifecycle.zero_infinity`). A no-op for every other run, and where
    :func:`hf_dist.callbacks.attach`'s guarded DeepSpeed load already repaired it. ``resume_from``: the checkpoint
    resumed when it is not ``output_dir/checkpoint-<global step>``."""

    def __init__(self, *, resume_from: str | None = None, trust_pickles: bool = False) -> None:
        self.resume_from = resume_from
        self.trust_pickles = trust_pickles

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        deepspeed_optimizer = zero_infinity.zero_infinity_optimizer(optimizer)
        if state.global_step == 0 or deepspeed_optimizer is None:
            return
        if zero_infinity.restored_from(deepspeed_optimizer) is not None:  # attach's guarded DeepSpeed load did it
            return
        checkpoint = Path(self.resume_from or Path(args.output_dir) / f"checkpoint-{state.global_step}")
        restored = zero_infinity.restore_resident_subgroups(
            deepspeed_optimizer, checkpoint, trust_pickles=self.trust_pickles
        )
        if state.is_world_process_zero:
            logger.info("ZeRO-Infinity resume: %d in-memory sub-group(s) restored from %s", restored, checkpoint)
