"""Read a DeepSpeed AutoTP checkpoint: one ZeRO-1/2 checkpoint per tensor-parallel rank, merged tensor by tensor.

Layout (deepspeed 0.19, ``DeepSpeedEngine._save_checkpoint`` with ``"tensor_parallel": {"autotp_size": N}``):
each TP rank ``M`` writes ``mp_rank_0M_model_states.pt`` and, per data-parallel rank ``R``,
``zero_pp_rank_R_mp_rank_0M_optim_states.pt``: the ZeRO-1/2 checkpoint of the slices that rank holds, read by
:class:`~hf_dist.checkpoint.formats.deepspeed.DeepSpeedReader` (``mp_rank=M``). How each tensor was split is
recorded in every model-states file's ``universal_checkpoint_info`` (the input of DeepSpeed's own
``ds_to_universal``): ``tp_replicated_parameter_patterns`` are whole on every rank (embeddings, norms),
``parameter_with_row_parallelism_patterns`` are split along dim 1 (``LinearAllreduce``: o_proj, down_proj), every
other tensor along dim 0 (``LinearLayer``: q/k/v/gate/up, ``lm_head``). Ranks may hold uneven slices (a
vocabulary of 103 rows splits 52 + 51), so the merged shape is the sum of the ranks' shapes.
"""

from __future__ import annotations

import re
from typing import Any

from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder
from hf_dist.checkpoint.formats.contents import CheckpointContents
from hf_dist.checkpoint.formats.deepspeed import DeepSpeedReader
from hf_dist.checkpoint.formats.reader import Reader, TensorSpec

REPLICATED, ROW_PARALLEL = "tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns"


class AutoTPReader(Reader):
    def __init__(self, checkpoint: CheckpointFolder, *, trust_pickles: bool = False) -> None:
        super().__init__()
        info = checkpoint.contents
        self.parts = [DeepSpeedReader(checkpoint, trust_pickles=trust_pickles, mp_rank=m) for m in range(info.tp_size)]
        first = self.parts[0]
        if first.stage == 3:
            raise ValueError(
                f"{info.path}: an AutoTP checkpoint with ZeRO-3 cannot be read by hf_dist yet (only ZeRO-1/2 AutoTP); "
                "use DeepSpeed's ds_to_universal.py"
            )
        self._dims = self._split_dims(first, info)
        for name, spec in first.specs().items():
            dim = self._dims[name]
            shape = list(spec.shape)
            if dim is not None:
                shape[dim] = sum(part.specs()[name].shape[dim] for part in self.parts)
            self._specs[name] = TensorSpec(tuple(shape), spec.dtype)
        self.aliases, self.train_dtype = first.aliases, first.train_dtype
        self.found = {**first.found, "world_size": first.world_size * info.tp_size}
        first.release()

    def _split_dims(self, first: DeepSpeedReader, info: CheckpointContents) -> dict[str, int | None]:
        """Per tensor: the dim its TP ranks split it along, None when every rank holds it whole."""
        states = first._load(first.model_file0)
        rules = states.get("universal_checkpoint_info") or {}
        if REPLICATED not in rules or ROW_PARALLEL not in rules:
            raise ValueError(
                f"{first.model_file0} does not record how AutoTP split its tensors (no universal_checkpoint_info with "
                f"{REPLICATED!r}; the DeepSpeed that wrote it predates them), so its {info.tp_size} tensor-parallel "
                "ranks cannot be merged: export the weights from the running engine (trainer.save_model(), which "
                "gathers AutoTP weights), or train with a newer DeepSpeed"
            )
        replicated = [re.compile(p) for p in rules[REPLICATED]]
        rows = [re.compile(p) for p in rules[ROW_PARALLEL]]
        names = set(first.specs())
        for part in self.parts[1:]:
            if set(part.specs()) != names:
                raise ValueError(
                    f"{info.path}: tensor-parallel rank {part.mp_rank} holds other tensors than rank 0 "
                    f"({sorted(set(part.specs()) ^ names)[:5]}); the rank files do not belong to one save"
                )
        dims: dict[str, int | None] = {}
        for name in first.specs():
            whole = name in first._buffer_names or not first.specs()[name].shape
            if whole or any(p.match(name) for p in replicated):
                dims[name] = None
            else:
                dims[name] = 1 if any(p.match(name) for p in rows) else 0
        return dims

    def read(self, names: list[str]) -> dict[str, Any]:
        import torch

        out = {}
        for name in names:
            dim = self._dims.get(name)
            if dim is None:  # whole on every rank (or a buffer): rank 0's copy
                out[name] = self.parts[0].read([name])[name]
            else:
                out[name] = torch.cat([part.read([name])[name] for part in self.parts], dim=dim)
        return out

    def release(self) -> None:
        for part in self.parts:
            part.release()
