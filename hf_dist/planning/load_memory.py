"""Host RAM while the model is loaded and handed to its engine, per node: the peak that kills a job before step 1.

How the engines load, read from the installed sources (transformers 5, accelerate 1.15, DeepSpeed 0.19) and
measured on CPU ranks (``tests/distributed/test_load_memory.py``):

- **Every rank reads the weights** (DDP, ZeRO-1/2, FSDP2). ``from_pretrained`` builds the whole model on each
  rank. safetensors files are memory-mapped: a tensor kept in the checkpoint's dtype is a view of the file, whose
  pages the page cache holds once per node however many ranks read them. A rank that holds the model in another
  dtype allocates its own copy: fp32 under mixed precision (``hf_dist.auto_args`` upcasts DDP's model; accelerate's
  ``fsdp2_prepare_model`` upcasts FSDP2's trainable parameters on every rank before sharding). FSDP's
  ``cpu_ram_efficient_loading`` no longer spares the other ranks at load in transformers 5 (its loader reads on
  every rank; only the missing-key initialisation looks at the flag: transformers#43749); accelerate still uses it
  to broadcast rank 0's weights when it shards.
- **Rank 0 reads, ZeRO-3 partitions** (the DeepSpeed config registered before ``from_pretrained``:
  ``TrainingArguments`` first, as the recipes do). ``deepspeed.zero.Init`` partitions every parameter to the
  devices as it is created; rank 0 alone reads the checkpoint (``map_location="meta"`` elsewhere) and hands each
  module's values to its gathered parameters, so host RAM holds the checkpoint's pages on the first node only.

A tensor-parallel model is sharded as it loads (``from_pretrained(tp_plan=...)``): each rank's copy is its 1/tp
slice; the node's ranks together still read every page of the checkpoint.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hf_dist.planning.dtypes import GIB
from hf_dist.planning.layout import Strategy, strategy


class LoadPath(enum.Enum):
    EVERY_RANK = "every rank reads the weights"
    RANK0_PARTITIONED = "rank 0 reads the weights, ZeRO-3 partitions them as they are created"


@dataclass(frozen=True)
class LoadMemory:
    """Host RAM at load on the busiest node. ``per_node`` is what must fit: each loading rank's own copy. The
    checkpoint's pages (``file_bytes``, once per node) are page cache, which the kernel evicts under pressure."""

    path: LoadPath
    ranks_per_node: int
    copy_bytes: int  # one rank's own copy of the weights (a dtype other than the checkpoint's); 0 for file views
    file_bytes: int  # the checkpoint's pages in the page cache, once per node
    copy_dtype_bytes: int = 0  # bytes per parameter of that copy

    @property
    def copies(self) -> int:
        return self.ranks_per_node if self.path is LoadPath.EVERY_RANK and self.copy_bytes else 0

    @property
    def per_node(self) -> int:
        return self.copies * self.copy_bytes

    @property
    def rank_peak(self) -> int:
        """What the resident set of the rank that reads the most shows at most: its copy and the file's pages."""
        return self.copy_bytes + self.file_bytes

    def text(self) -> str:
        pages = f"{_gib(self.file_bytes)} of checkpoint pages in the page cache, which it can evict"
        if not self.copies:
            return f"no copy of the weights ({self.path.value}; {pages})"
        copy = f"{self.copies} ranks x {_gib(self.copy_bytes)} fp{8 * self.copy_dtype_bytes} copy"
        return f"{_gib(self.per_node)} per node ({self.path.value}: {copy}; + {pages})"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def load_memory(
    num_params: int,
    s: Strategy | str,
    *,
    held_bytes: int,
    checkpoint_bytes: int = 2,
    ranks_per_node: int = 1,
    tp_size: int = 1,
) -> LoadMemory:
    """Host RAM at load for ``num_params`` weights stored with ``checkpoint_bytes`` per parameter, which each rank
    holds with ``held_bytes`` per parameter until its engine moves them to the device (the plan's weight dtype; a
    LoRA model's frozen base stays as loaded); a tensor-parallel rank holds its 1/``tp_size`` slice."""
    file_bytes = num_params * checkpoint_bytes
    if strategy(s).zero_stage == 3:
        return LoadMemory(LoadPath.RANK0_PARTITIONED, ranks_per_node, 0, file_bytes)
    copy = num_params * held_bytes // tp_size if held_bytes != checkpoint_bytes else 0
    return LoadMemory(LoadPath.EVERY_RANK, ranks_per_node, copy, file_bytes, held_bytes)
