"""The interface every checkpoint reader implements: tensor specs first, then tensors in batches.

A converter plans the output (shards, validation) from :meth:`Reader.specs` alone and then asks
for a few tensors at a time, calling :meth:`Reader.release` between batches so memory-mapped
source pages are unmapped and resident memory stays bounded by one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class TensorSpec:
    """Shape and stored dtype of one tensor of the source checkpoint."""

    shape: tuple[int, ...]
    dtype: Any  # torch.dtype

    @cached_property  # specs are asked for their sizes many times while batches are planned
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Reader:
    """Base class: subclasses fill ``_specs`` (ordered) and implement :meth:`read`."""

    train_dtype: str | None = None  # "bf16" | "fp16" | "fp32" when the checkpoint says so
    aliases: dict[str, str]  # tied/shared names -> the name that holds the data
    # what opening the files told of the checkpoint (CheckpointContents fields: stage, world_size, train_dtype);
    # the contents it was given are never changed
    found: dict[str, Any]

    def __init__(self) -> None:
        self._specs: dict[str, TensorSpec] = {}
        self.aliases = {}
        self.found = {}

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def read(self, names: list[str]) -> dict[str, Any]:
        raise NotImplementedError

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """Where the stored bytes of ``name`` lie, in C order, as ``(file, offset, length)``; None when they don't.

        A converter writing ``name`` unchanged (same dtype, no merge) copies these ranges file to file
        (:func:`hf_dist.checkpoint.write.hf_folder.copy_ranges`) instead of reading the tensor into memory.
        """
        return None

    def release(self) -> None:
        """Drop cached file handles / memory maps (called between output shards)."""

    def close(self) -> None:
        self.release()
