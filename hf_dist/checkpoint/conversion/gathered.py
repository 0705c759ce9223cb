"""A ZeRO checkpoint without hf_dist's manifest, checked against the weights the Trainer gathered beside it.

The Trainer's ``save_model`` writes the module's gathered weights (``model.safetensors``, in the training dtype) into
the same ``checkpoint-N`` folder as DeepSpeed's rank files (ZeRO-1/2 always; ZeRO-3 with
``stage3_gather_16bit_weights_on_model_save``). After every optimizer step DeepSpeed copies its fp32 masters (in the
optimizer files or ZeRO-Infinity's swap files) into those 16-bit weights by a round-to-nearest cast, so each tensor
read from the rank files, cast to the gathered dtype, equals its gathered copy bit for bit. Two ranks' files
exchanged, a partition overwritten or a swap file of another run do not: :class:`GatheredCheck` refuses them before
the output folder is renamed into place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder, open_checkpoint
from hf_dist.checkpoint.formats.hf import HFReader
from hf_dist.checkpoint.formats.names import CHECKPOINT_DIR_RE, HF_WEIGHT_NAMES
from hf_dist.checkpoint.formats.reader import Reader

_MODEL_WEIGHTS = tuple(n for n in HF_WEIGHT_NAMES if not n.startswith("adapter_"))


class GatheredCopyMismatch(ValueError):
    """A tensor read from the rank files differs from the copy the Trainer gathered at the same save."""


def gathered_weights(checkpoint: CheckpointFolder) -> Path | None:
    """The gathered model weights in a Trainer ``checkpoint-N`` folder beside its own tag ``global_stepN`` (one save
    wrote both), when there are some. A DeepSpeed folder of several tags, or weights saved at another step, is not
    compared; nor is AutoTP, whose Trainer save was never compared with its rank files on a real run."""
    info = checkpoint.contents
    own_folder = CHECKPOINT_DIR_RE.match(checkpoint.root.name)
    if info.format != "deepspeed" or info.tp_size > 1 or own_folder is None:
        return None
    if info.tag != f"global_step{own_folder.group(1)}":
        return None
    return next((path for path in map(checkpoint.path, _MODEL_WEIGHTS) if path.is_file()), None)


class GatheredCheck(Reader):
    """``reader`` whose reads are compared with the gathered copy in ``weights``.

    ``names`` maps each source tensor compared to its name in the gathered file (the output name of a tensor written
    unchanged; merged LoRA pairs are not compared). No byte ranges are offered: every compared tensor is read.
    """

    def __init__(self, reader: Reader, weights: Path, names: dict[str, str], *, trust_pickles: bool = False) -> None:
        super().__init__()
        self.reader, self.weights = reader, weights
        self._specs, self.aliases, self.train_dtype = reader.specs(), reader.aliases, reader.train_dtype
        self.gathered = HFReader(open_checkpoint(weights), trust_pickles=trust_pickles)
        copies = self.gathered.specs()
        self.names = {source: out for source, out in names.items() if out in copies}
        self.checked: set[str] = set()

    def read(self, names: list[str]) -> dict[str, Any]:
        import torch

        tensors = self.reader.read(names)
        compared = [n for n in names if n in self.names]
        copies = self.gathered.read([self.names[n] for n in compared]) if compared else {}
        for name in compared:
            copy = copies[self.names[name]]
            value = tensors[name]
            if value.shape != copy.shape or not torch.equal(value.to(copy.dtype), copy):
                raise GatheredCopyMismatch(_mismatch(name, value, copy, self.weights))
            self.checked.add(name)
        return tensors

    def release(self) -> None:
        self.reader.release()
        self.gathered.release()

    def close(self) -> None:
        self.reader.close()
        self.gathered.close()

    def note(self, total: int) -> str:
        """What the check showed, for the conversion summary (``total``: the tensors written)."""
        return (
            f"{len(self.checked)} of the {total} tensors written, read from the rank files, equal the weights the "
            f"Trainer gathered at the same save ({self.weights.name})"
        )


def _mismatch(name: str, value: Any, copy: Any, weights: Path) -> str:
    if value.shape != copy.shape:
        detail = f"shape {tuple(value.shape)} against {tuple(copy.shape)}"
    else:
        detail = f"max difference {(value.to(copy.dtype).float() - copy.float()).abs().max().item():.3g}"
    return (
        f"{name} read from the rank files differs from its copy in {weights} ({detail}), which the Trainer gathered at "
        "the same save: rank or swap files were exchanged, overwritten or come from another run. Nothing was "
        "written; convert the gathered weights instead (pass the folder's model file) or restore the rank files"
    )


def checked_reader(checkpoint: CheckpointFolder, reader: Reader, names: dict[str, str], *,
                   trust_pickles: bool = False) -> Reader:  # fmt: skip
    """``reader`` wrapped in a :class:`GatheredCheck` when the checkpoint is a ZeRO checkpoint without a manifest that
    holds gathered weights; ``names`` maps the source of each output tensor written unchanged to its output name."""
    weights = gathered_weights(checkpoint)
    if weights is None:
        return reader
    return GatheredCheck(reader, weights, names, trust_pickles=trust_pickles)


def verification_notes(reader: Reader, unverified: str, written: int) -> tuple[str, str]:
    """The conversion summary's ``(checked, note)``: what the check compared, and ``unverified`` unless it compared
    all ``written`` tensors."""
    if not isinstance(reader, GatheredCheck) or not reader.checked:
        return "", unverified
    return reader.note(written), "" if len(reader.checked) == written else unverified
