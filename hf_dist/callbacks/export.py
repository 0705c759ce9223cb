"""ExportCallback: write a consolidated Hugging Face folder (or PEFT adapter) on rank 0 after every rank saved."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_dist.atomic_io import atomic_dir
from hf_dist.callbacks.phases import Phase, phase
from hf_dist.checkpoint.safety.paths import ConfinedFolder
from hf_dist.planning.layout import Strategy, strategy
from hf_dist.runtime import dist as _dist

logger = logging.getLogger(__name__)


def _full_state_dict(model: Any, running: Strategy) -> dict | None:
    """Full (unsharded) state dict on rank 0 for FSDP; None means "the module already holds full weights"."""
    if not running.is_fsdp:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Collective: every rank must call it; only rank 0 receives tensors (cpu_offload).
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def ended_with(args: Any, state: Any) -> Path:
    """The checkpoint whose weights the Trainer holds at the end: the best one under ``load_best_model_at_end`` (the
    Trainer loads it back before ``on_train_end``), else the last step's. A best checkpoint that is not a
    ``checkpoint-N`` of this run's ``output_dir`` with a matching manifest
    (:func:`~hf_dist.checkpoint.safety.trainer_loads.best_checkpoint_problem`: its name was read from a file) is never
    exported: the last step's is, with one warning (``attach`` drops such a name before the Trainer loads it)."""
    last = Path(args.output_dir) / f"checkpoint-{state.global_step}"
    best = getattr(state, "best_model_checkpoint", None)
    if not (getattr(args, "load_best_model_at_end", False) and best):
        return last
    from hf_dist.checkpoint.safety.trainer_loads import best_checkpoint_problem

    problem = best_checkpoint_problem(best, args.output_dir)
    if problem is not None:
        logger.warning("hf_dist: not exporting best_model_checkpoint %s: %s; exporting %s", best, problem, last)
        return last
    return Path(best)


class ExportCallback(TrainerCallback):
    """Exports loadable weights: ``OUTPUT_DIR/<name>`` at train end (the weights the Trainer ends with: the best
    checkpoint's under ``load_best_model_at_end``), ``checkpoint-N/<name>`` on each save if ``on_save`` (added to
    that checkpoint's manifest).

    DDP and ZeRO-1/2 hold full weights in every process: rank 0 calls ``save_pretrained`` (a PEFT
    model writes its adapter). FSDP gathers a full state dict first (collective). ZeRO-3 converts
    the step's checkpoint with ``hf_dist.convert``. The folder is written under a temporary name
    and renamed, so a crash never leaves a half-written export in place. ``trust_remote_code=True``: that
    conversion may import the model config's ``auto_map`` code (:mod:`hf_dist.planning.remote_code`).
    """

    def __init__(
        self,
        *,
        name: str = "hf_model",
        on_save: bool = False,
        safe_serialization: bool = True,
        trust_remote_code: bool = False,
    ) -> None:
        if not name or os.sep in name or name.startswith("checkpoint-"):
            raise ValueError(f"name must be a plain folder name not starting with 'checkpoint-', got {name!r}")
        self.name = name
        self.on_save_enabled = on_save
        self.safe_serialization = safe_serialization
        self.trust_remote_code = trust_remote_code
        self.exported: list[str] = []

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.on_save_enabled:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.export(
                ConfinedFolder(checkpoint).path(self.name), state, model, processing_class, checkpoint=checkpoint
            )

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        checkpoint = ended_with(args, state)  # ZeRO-3 converts it: the best one when the Trainer loaded it back
        self.export(Path(args.output_dir) / self.name, state, model, processing_class, checkpoint=checkpoint)

    def export(self, dst: Path, state: Any, model: Any, processing_class: Any = None, *, checkpoint: Path) -> None:
        """Collective: every rank calls it; rank 0 writes ``dst`` (the other ranks wait in a barrier)."""
        with phase(Phase.EXPORT):
            self._export(dst, state, model, processing_class, checkpoint=checkpoint)

    def _export(self, dst: Path, state: Any, model: Any, processing_class: Any, *, checkpoint: Path) -> None:
        running = strategy(_dist.live_strategy())
        _dist.barrier()  # every rank finished writing the checkpoint
        state_dict = _full_state_dict(model, running)
        if state.is_world_process_zero:
            # next to the checkpoint, not inside it: convert refuses to write into its own source
            where = checkpoint.parent if dst.parent == checkpoint else dst.parent
            with atomic_dir(dst, overwrite=True, temp_parent=where) as tmp:
                if running.is_deepspeed and running.shards.params:  # ZeRO-3: no rank holds the whole model
                    self._convert_checkpoint(checkpoint, tmp, self.trust_remote_code)
                else:
                    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=self.safe_serialization)
                if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                    processing_class.save_pretrained(tmp)
            self.exported.append(str(dst))
            if dst.parent == checkpoint:  # written into a complete checkpoint: its manifest lists the export too
                from hf_dist.checkpoint.lifecycle.manifest import checkpoint_files, extend_manifest

                extend_manifest(checkpoint, [f for f in checkpoint_files(checkpoint) if f.startswith(f"{dst.name}/")])
            logger.info("hf_dist: exported %s weights to %s", running.name, dst)
        _dist.barrier()

    @staticmethod
    def _convert_checkpoint(checkpoint: Path, tmp: Path, trust_remote_code: bool) -> None:
        if not checkpoint.is_dir():
            raise RuntimeError(
                f"ZeRO-3 export needs the checkpoint of this step ({checkpoint}), which does not exist; "
                "use save_strategy='steps' (the Trainer then saves at the last step) or run `hf-dist convert`"
            )
        from hf_dist.checkpoint.conversion.convert import convert

        shutil.rmtree(tmp)  # convert writes its own folder and refuses an existing one
        convert(str(checkpoint), str(tmp), progress=False, trust_remote_code=trust_remote_code)
