"""``CompleteCheckpointCallback``: after each save, once every rank finished, rank 0 marks the checkpoint complete.

The marker (:mod:`hf_dist.checkpoint.marker`) is what :func:`hf_dist.auto_resume`
(:mod:`hf_dist.checkpoint.auto_resume`) trusts: it resumes only from checkpoints every rank finished.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from hf_dist.checkpoint.marker import write_marker
from hf_dist.runtime import dist as _dist

__all__ = ["CompleteCheckpointCallback"]

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
