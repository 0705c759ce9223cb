"""ExportCallback: write a consolidated Hugging Face folder (or PEFT adapter) on rank 0 after every rank saved."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_dist.callbacks import _dist

logger = logging.getLogger(__name__)


def _replace_dir(tmp: Path, dst: Path) -> None:
    """Move the finished ``tmp`` folder to ``dst``; an existing ``dst`` is replaced only once ``tmp`` is complete."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
    os.replace(tmp, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _full_state_dict(model: Any, strategy: str) -> dict | None:
    """Full (unsharded) state dict on rank 0 for FSDP; None means "the module already holds full weights"."""
    if not strategy.startswith("fsdp") and strategy != "hsdp":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Collective: every rank must call it; only rank 0 receives tensors (cpu_offload).
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class ExportCallback(TrainerCallback):
    """Exports loadable weights: ``OUTPUT_DIR/<name>`` at train end, ``checkpoint-N/<name>`` on each save if ``on_save``.

    DDP and ZeRO-1/2 hold full weights in every process: rank 0 calls ``save_pretrained`` (a PEFT
    model writes its adapter). FSDP gathers a full state dict first (collective). ZeRO-3 converts
    the step's checkpoint with ``hf_dist.convert``. The folder is written under a temporary name
    and renamed, so a crash never leaves a half-written export in place.
    """

    def __init__(self, *, name: str = "hf_model", on_save: bool = False, safe_serialization: bool = True) -> None:
        if not name or os.sep in name or name.startswith("checkpoint-"):
            raise ValueError(f"name must be a plain folder name not starting with 'checkpoint-', got {name!r}")
        self.name = name
        self.on_save_enabled = on_save
        self.safe_serialization = safe_serialization
        self.exported: list[str] = []

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.on_save_enabled:
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            self.export(checkpoint / self.name, state, model, processing_class, checkpoint=checkpoint)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.export(Path(args.output_dir) / self.name, state, model, processing_class, checkpoint=checkpoint)

    def export(self, dst: Path, state: Any, model: Any, processing_class: Any = None, *, checkpoint: Path) -> None:
        """Collective: every rank calls it; rank 0 writes ``dst``."""
        strategy = _dist.live_strategy()
        _dist.barrier()  # every rank finished writing the checkpoint
        state_dict = _full_state_dict(model, strategy)
        if state.is_world_process_zero:
            dst.parent.mkdir(parents=True, exist_ok=True)
            # next to the checkpoint, not inside it: convert refuses to write into its own source
            where = checkpoint.parent if dst.parent == checkpoint else dst.parent
            tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=where))
            try:
                if strategy == "zero3":
                    self._convert_checkpoint(checkpoint, tmp)
                else:
                    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=self.safe_serialization)
                if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                    processing_class.save_pretrained(tmp)
                _replace_dir(tmp, dst)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self.exported.append(str(dst))
            logger.info("hf_dist: exported %s weights to %s", strategy, dst)
        _dist.barrier()

    @staticmethod
    def _convert_checkpoint(checkpoint: Path, tmp: Path) -> None:
        if not checkpoint.is_dir():
            raise RuntimeError(
                f"ZeRO-3 export needs the checkpoint of this step ({checkpoint}), which does not exist; "
                "use save_strategy='steps' (the Trainer then saves at the last step) or run `hf-dist convert`"
            )
        from hf_dist.checkpoint.convert import convert

        shutil.rmtree(tmp)  # convert writes its own folder and refuses an existing one
        convert(str(checkpoint), str(tmp), progress=False)
