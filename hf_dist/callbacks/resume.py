"""Callbacks that make a run resumable.

``CompleteCheckpointCallback``: after each save, once every rank finished, rank 0 marks the checkpoint complete.
The marker (:mod:`hf_dist.checkpoint.marker`) is what :func:`hf_dist.auto_resume`
(:mod:`hf_dist.checkpoint.auto_resume`) trusts: it resumes only from checkpoints every rank finished.

``ShardedResumeCallback``: saves and restores the optimizer and scheduler of a model sharded at load time
(tensor parallelism, FSDP2 x TP), which the Trainer cannot (:mod:`hf_dist.checkpoint.sharded_state`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from hf_dist.checkpoint import sharded_state
from hf_dist.checkpoint.marker import write_marker
from hf_dist.runtime import dist as _dist

__all__ = ["CompleteCheckpointCallback", "ShardedResumeCallback"]

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
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        # on_save runs after _save_checkpoint returned on this rank; the barrier makes it "on every rank".
        _dist.barrier()
        if state.is_world_process_zero and checkpoint.is_dir():
            try:
                write_marker(
                    checkpoint,
                    world_size=max(_dist.world_size(), args.world_size),
                    strategy=_dist.live_strategy(args),
                    step=state.global_step,
                    checksums=self.checksums,
                )
            except RuntimeError as exc:
                logger.error("%s", exc)
        # Later callbacks (export) and the next save must see the marker.
        _dist.barrier()


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
            sharded_state.save_optimizer_state(checkpoint, model, optimizer, lr_scheduler)
            if args.save_only_model:  # the Trainer left its RNG files out; it reads them back on resume itself
                sharded_state.save_rng_state(checkpoint, args.world_size)
