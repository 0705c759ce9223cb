"""Callbacks that make a run resumable.

``CompleteCheckpointCallback``: after each save, once every rank finished, rank 0 marks the checkpoint complete.
The marker (:mod:`hf_dist.checkpoint.lifecycle.marker`) is what :func:`hf_dist.auto_resume`
(:mod:`hf_dist.checkpoint.lifecycle.auto_resume`) trusts: it resumes only from checkpoints every rank finished.

``ShardedResumeCallback``: saves and restores the optimizer and scheduler of a model sharded at load time
(tensor parallelism, FSDP2 x TP), which the Trainer cannot (:mod:`hf_dist.checkpoint.lifecycle.sharded_state`).

``ZeroInfinityResumeCallback``: restores the optimizer state that DeepSpeed's own NVMe resume drops
(:mod:`hf_dist.checkpoint.lifecycle.zero_infinity`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from transformers import TrainerCallback

from hf_dist.callbacks.phases import Phase, phase
from hf_dist.checkpoint.lifecycle import sharded_state, zero_infinity
from hf_dist.checkpoint.lifecycle.marker import clear_writing, mark_writing, write_marker
from hf_dist.runtime import dist as _dist

__all__ = [
    "AsyncCheckpointCallback",
    "CompleteCheckpointCallback",
    "ShardedResumeCallback",
    "ZeroInfinityResumeCallback",
]

logger = logging.getLogger(__name__)


class CompleteCheckpointCallback(TrainerCallback):
    """After each save, waits for every rank, then rank 0 marks the checkpoint complete.

    Must be registered on every rank (as Trainer callbacks always are): it calls a barrier.
    """

    def __init__(self, *, checksums: bool = False) -> None:
        self.checksums = checksums

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero and args.save_total_limit == 1:
            logger.warning(
                "save_total_limit=1: the Trainer deletes the previous checkpoint before the new one is complete on "
                "every rank, so a crash during a save leaves nothing to resume from; use save_total_limit >= 2"
            )

    def on_save(self, args, state, control, **kwargs):
        self.mark(args, state, state.global_step)

    def mark(self, args, state, step: int) -> None:
        """Collective: once every rank got here, rank 0 marks ``checkpoint-<step>`` complete."""
        with phase(Phase.SAVE):  # the barrier waits for the slowest rank's save
            self._mark(args, state, step)

    def _mark(self, args, state, step: int) -> None:
        checkpoint = Path(args.output_dir) / f"checkpoint-{step}"
        # on_save runs after _save_checkpoint returned on this rank; the barrier makes it "on every rank".
        _dist.barrier()
        if state.is_world_process_zero and checkpoint.is_dir():
            clear_writing(checkpoint)  # an async save's note; it must not be listed, and the marker now speaks
            try:
                write_marker(
                    checkpoint,
                    world_size=max(_dist.world_size(), args.world_size),
                    strategy=_dist.live_strategy(args),
                    step=step,
                    checksums=self.checksums,
                )
            except RuntimeError as exc:
                logger.error("%s", exc)
        # Later callbacks (export) and the next save must see the marker.
        _dist.barrier()


class AsyncCheckpointCallback(CompleteCheckpointCallback):
    """Checkpoints that don't stall training: the Trainer's save stages its state to host memory and returns; a
    thread writes ``checkpoint-N/`` in the Trainer's own layout (:mod:`hf_dist.checkpoint.lifecycle.async_save` says what is
    written in the background and what is not). Replaces :class:`CompleteCheckpointCallback`
    (``attach(trainer, async_save=True)``): the completion marker is written only once every rank's background
    writes finished, so a job killed during them resumes from the checkpoint before.

    Each step end asks every rank whether its writes ended (one small all-gather, only while a save is under way);
    the next save and the end of training wait for them. A failed write raises :class:`AsyncSaveError` on every
    rank and leaves the checkpoint unmarked. DeepSpeed writes its checkpoint itself: there the saves stay
    synchronous, said once. Before training, the staging copy (this rank's weights and optimizer state) is checked
    against each node's available host memory.
    """

    def __init__(self, *, checksums: bool = False) -> None:
        super().__init__(checksums=checksums)
        self.trainer = None  # set by attach(); the Trainer's _save_checkpoint is wrapped
        self.writer = None
        self.pending_step: int | None = None
        self.stalls: list[float] = []  # seconds each save held the training thread
        self.written_s: list[float] = []  # seconds from each save's start until it was marked complete
        self.staged_bytes = 0  # the largest staging copy of this rank so far
        self._save_start = 0.0
        self._wrapped = False

    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise ValueError(
                "AsyncCheckpointCallback wraps the Trainer's save, so it needs the trainer: add it with "
                "hf_dist.callbacks.attach(trainer, async_save=True) instead of Trainer(callbacks=[...])"
            )

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        from hf_dist.checkpoint.lifecycle.async_save import BackgroundWriter, check_staging_fits
        from hf_dist.planning.layout import strategy

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
        if not self._wrapped:  # once per Trainer, however many times it trains
            self._wrap_save()

    def _wrap_save(self) -> None:
        trainer, save = self.trainer, self.trainer._save_checkpoint

        def save_in_background(model, trial):
            if self.writer is None:  # DeepSpeed, or outside train(): the Trainer's own save
                return save(model, trial)
            with phase(Phase.SAVE):  # the wait for the previous save's writes, then the staging
                self.finish(trainer.args, trainer.state, block=True)  # the staging buffers are reused
                start = time.perf_counter()
                if trainer.args.should_save:  # before any file: the folder proves nothing until marked
                    step = trainer.state.global_step
                    mark_writing(Path(trainer.args.output_dir) / f"checkpoint-{step}", step)
                with self.writer.intercept():
                    save(model, trial)
            self.stalls.append(time.perf_counter() - start)
            self.staged_bytes = max(self.staged_bytes, self.writer.staged_bytes)
            self.pending_step, self._save_start = trainer.state.global_step, start

        trainer._save_checkpoint = save_in_background
        self._wrapped = True

    def on_save(self, args, state, control, **kwargs):
        if self.writer is None:  # DeepSpeed: synchronous
            super().on_save(args, state, control, **kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending_step is not None:
            self.finish(args, state, block=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            with phase(Phase.SAVE):  # the last save's background writes
                self.finish(args, state, block=True)
            self.writer.close()
            self.writer = None

    def finish(self, args, state, *, block: bool) -> None:
        """Collective: if every rank's writes of the pending save ended, check them and mark the checkpoint."""
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
                "It is left without hf_dist's completion marker, so auto_resume resumes from the checkpoint before. "
                "Fix the cause (disk space, permissions) or train without async_save"
            )
        self.mark(args, state, step)
        self.written_s.append(time.perf_counter() - self._save_start)
        if state.is_world_process_zero:
            logger.info("hf_dist: checkpoint-%d written in the background and marked complete", step)


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
    (:mod:`hf_dist.checkpoint.lifecycle.zero_infinity`). A no-op for every other run. ``resume_from``: the checkpoint resumed
    when it is not ``output_dir/checkpoint-<global step>``."""

    def __init__(self, *, resume_from: str | None = None, trust_pickles: bool = False) -> None:
        self.resume_from = resume_from
        self.trust_pickles = trust_pickles

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        deepspeed_optimizer = zero_infinity.zero_infinity_optimizer(optimizer)
        if state.global_step == 0 or deepspeed_optimizer is None:
            return
        checkpoint = Path(self.resume_from or Path(args.output_dir) / f"checkpoint-{state.global_step}")
        restored = zero_infinity.restore_resident_subgroups(
            deepspeed_optimizer, checkpoint, trust_pickles=self.trust_pickles
        )
        if state.is_world_process_zero:
            logger.info("ZeRO-Infinity resume: %d in-memory sub-group(s) restored from %s", restored, checkpoint)
