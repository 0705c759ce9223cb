"""Stream parameters out of a DeepSpeed ZeRO-1/2/3 checkpoint without consolidating it in memory.

Layout (deepspeed 0.19, ``deepspeed/utils/zero_to_fp32.py`` is the reference decoder):

* ZeRO-1/2: per param group, the fp32 master weights are one flat vector split into equal
  partitions, rank R's partition in ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``
  (``single_partition_of_fp32_groups``). Params follow each other in ``param_shapes`` order,
  each followed by ``param_alignment_paddings`` elements when present.
* ZeRO-3: every param is split on its own: ``ceil(numel / world)`` elements per rank (the last
  rank zero-padded), laid out in ``param_shapes`` order in the rank's ``fp32_flat_groups``.
* ZeRO-Infinity (ZeRO-3 with the optimizer offloaded to NVMe): a sub-group whose master partition was swapped out
  has an empty tensor in ``fp32_flat_groups`` (its ``ds_id`` kept as an attribute); the partition is the raw fp32
  file ``offloaded_tensors/rankNN/<ds_id>.tensor.swp`` that ``save_checkpoint`` copies next to the rank files (engine.py),
  its length padded to DeepSpeed's I/O alignment. The sub-groups are the param groups cut at ``sub_group_size``
  elements per rank (stage3.py ``_create_fp16_sub_groups``), which gives each file's true length.
* Frozen params (e.g. a LoRA base model) have no master copy: ZeRO-1/2 keep them whole in
  ``mp_rank_00_model_states.pt``; ZeRO-3 keeps per-rank fragments in each rank's model states.

Each parameter is described once as a list of pieces ``(rank, group, start, length)``; reading it
slices those pieces out of memory-mapped files. :meth:`release` unmaps the files between batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder
from hf_dist.checkpoint.formats.names import OPTIM_FILE_RE, PIPELINE_LAYER_GLOB, ZERO3_MODEL_FILE_RE, tp_model_file
from hf_dist.checkpoint.formats.reader import Reader, TensorSpec
from hf_dist.checkpoint.safety.loading import safe_load
from hf_dist.checkpoint.safety.paths import ConfinedFolder


@dataclass(frozen=True)
class Piece:
    """``length`` elements from ``start`` of the flat fp32 group ``group`` of rank ``rank``'s optimizer file."""

    rank: int
    group: int
    start: int
    length: int


@dataclass
class ParamSource:
    shape: tuple[int, ...]
    pieces: list[Piece] | None = None  # fp32 master weights in optimizer files
    frozen: bool = False  # 16-bit value in model-states files


class DeepSpeedReader(Reader):
    """The data-parallel ZeRO checkpoint of one tensor-parallel rank ``mp_rank`` (0: the only one without AutoTP;
    :class:`hf_dist.checkpoint.formats.autotp.AutoTPReader` merges the ranks of an AutoTP checkpoint)."""

    def __init__(self, checkpoint: CheckpointFolder, *, trust_pickles: bool = False, mp_rank: int = 0) -> None:
        super().__init__()
        self.info, self._data = checkpoint.contents, checkpoint.data
        info = self.info
        self.trust_pickles = trust_pickles
        self.mp_rank = mp_rank
        self._cache: dict[Path, Any] = {}
        self._group_offsets: dict[int, list[int | None]] = {}
        tag_dir = info.path
        self.optim_files = self._optim_files(tag_dir)
        model_files = sorted(
            p for p in tag_dir.iterdir() if (m := ZERO3_MODEL_FILE_RE.match(p.name)) and int(m["mp"]) == mp_rank
        )
        self.model_file0 = model_files[0] if model_files else tp_model_file(tag_dir, mp_rank)
        model_states = self._load(self.model_file0)
        for key in ("param_shapes", "module"):
            if key not in model_states:
                raise ValueError(f"{self.model_file0} is not a DeepSpeed model-states file (no {key!r} entry)")
        self.world_size = int(model_states.get("dp_world_size") or len(self.optim_files))
        self._check_ranks(tag_dir, model_files)
        optim0 = self._optim(0)
        self.stage = int(optim0["zero_stage"])
        if self.stage not in (1, 2, 3):
            raise ValueError(f"{self.optim_files[0]}: ZeRO stage {self.stage} cannot be read; supported: 1, 2, 3")
        self.train_dtype = _train_dtype(model_states.get("ds_config") or {}, info.train_dtype)
        self.model_files = model_files
        self._frozen_shapes = dict(model_states.get("frozen_param_shapes") or {})
        sub_group = ((model_states.get("ds_config") or {}).get("zero_optimization") or {}).get("sub_group_size")
        self._sub_group_sizes = zero3_sub_groups(model_states["param_shapes"], self.world_size, sub_group)
        self._buffer_names = list(model_states.get("buffer_names") or [])
        self._index_params([dict(group) for group in model_states["param_shapes"]])
        for name in self._buffer_names:
            tensor = model_states["module"][name]
            self._specs[name] = TensorSpec(tuple(tensor.shape), tensor.dtype)
        self.aliases = dict(model_states.get("shared_params") or {})
        # DeepSpeed's own LR scheduler (a DeepSpeed config with a "scheduler" section) saves its state here, and the
        # Trainer then writes no scheduler.pt (transformers' _save_scheduler)
        self.holds_scheduler = model_states.get("lr_scheduler") is not None
        self.found = {"stage": self.stage, "world_size": self.world_size, "train_dtype": self.train_dtype}
        self.release()

    # -- layout -------------------------------------------------------------------------------
    def _optim_files(self, tag_dir: Path) -> list[Path]:
        files = [p for p in tag_dir.iterdir() if OPTIM_FILE_RE.match(p.name)]
        if not files:
            raise FileNotFoundError(
                f"no *_optim_states.pt files in {tag_dir}: the fp32 master weights are missing "
                "(was the checkpoint saved with save_checkpoint on every rank?)"
            )
        if any(tag_dir.glob(PIPELINE_LAYER_GLOB)):
            raise ValueError(
                f"{tag_dir} is a pipeline-parallel DeepSpeed checkpoint (layer_* files); only data-parallel ZeRO-1/2/3 "
                "and AutoTP checkpoints can be read. Use DeepSpeed's ds_to_universal.py"
            )
        files = [p for p in files if int(OPTIM_FILE_RE.match(p.name)["mp"]) == self.mp_rank]
        if not files:
            raise FileNotFoundError(
                f"no *_mp_rank_{self.mp_rank:02d}_optim_states.pt files in {tag_dir}, although other tensor-parallel "
                "ranks wrote theirs: copy the complete checkpoint folder (every rank's files of one save)"
            )
        return sorted(files, key=lambda p: int(OPTIM_FILE_RE.match(p.name)["rank"]))

    def _check_ranks(self, tag_dir: Path, model_files: list[Path]) -> None:
        ranks = [int(OPTIM_FILE_RE.match(p.name)["rank"]) for p in self.optim_files]
        expected = list(range(self.world_size))
        if ranks != expected:
            missing = sorted(set(expected) - set(ranks))
            extra = sorted(set(ranks) - set(expected))
            raise ValueError(
                f"{tag_dir} was saved by {self.world_size} ranks but has optimizer files for ranks {ranks}"
                + (f" of tensor-parallel rank {self.mp_rank} (mp_rank_{self.mp_rank:02d})" if self.mp_rank else "")
                + (f"; missing rank(s) {missing}" if missing else "")
                + (f"; unexpected rank(s) {extra} (files from a run with another world size?)" if extra else "")
                + ". Copy the complete checkpoint folder (all rank files of one save)"
            )
        if model_files and len(model_files) != self.world_size:
            raise ValueError(
                f"{tag_dir} was saved by {self.world_size} ranks but has {len(model_files)} ZeRO-3 model-states "
                "files; copy the complete checkpoint folder"
            )

    def _index_params(self, groups: list[dict]) -> None:
        self._sources: dict[str, ParamSource] = {}
        group_sizes = [[int(t.numel()) for t in self._flat_groups(r)] for r in range(self.world_size)]
        if any(sizes != group_sizes[0] for sizes in group_sizes):
            raise ValueError(f"rank files in {self.info.path} disagree on partition sizes {group_sizes}")
        if self.stage == 3:
            self._index_zero3(groups, group_sizes[0])
        else:
            self._index_zero12(groups, group_sizes[0])
        for name, shape in self._frozen_shapes.items():
            self._sources[name] = ParamSource(tuple(shape), frozen=True)
        # stored dtype: fp32 masters for trained params, the module's dtype for frozen ones
        import torch

        frozen_dtype = self._frozen_dtype()
        for name, source in self._sources.items():
            dtype = frozen_dtype if source.frozen else torch.float32
            self._specs[name] = TensorSpec(source.shape, dtype)

    def _index_zero12(self, groups: list[dict], partition_sizes: list[int]) -> None:
        paddings = self._optim(0).get("param_alignment_paddings")
        for g, shapes in enumerate(groups):
            size = partition_sizes[g]
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                numel = math.prod(shape)
                pieces = []
                pos = offset
                while pos < offset + numel:
                    rank, start = divmod(pos, size)
                    length = min(size - start, offset + numel - pos)
                    pieces.append(Piece(rank, g, start, length))
                    pos += length
                self._sources[name] = ParamSource(tuple(shape), pieces)
                offset += numel + (paddings[g][i] if paddings else 0)
            if offset > size * self.world_size:
                raise ValueError(
                    f"param group {g} needs {offset} elements but the rank files hold {size * self.world_size}"
                )

    def _index_zero3(self, groups: list[dict], group_sizes: list[int]) -> None:
        bounds = [0]
        for size in group_sizes:
            bounds.append(bounds[-1] + size)
        offset = 0
        for shapes in groups:
            for name, shape in shapes.items():
                per_rank = math.ceil(math.prod(shape) / self.world_size)
                pieces = [p for r in range(self.world_size) for p in _split_range(r, offset, per_rank, bounds)]
                self._sources[name] = ParamSource(tuple(shape), pieces)
                offset += per_rank
        if offset != bounds[-1]:
            raise ValueError(
                f"ZeRO-3 partitions in {self.info.path} hold {bounds[-1]} elements per rank but param_shapes need "
                f"{offset}; the model-states and optimizer files do not belong together"
            )

    def _frozen_dtype(self):
        import torch

        for name in self._frozen_shapes:
            fragments = self._load(self.model_file0).get("frozen_param_fragments") or {}
            if name in fragments:
                return fragments[name].dtype
        return torch.float32

    # -- file access --------------------------------------------------------------------------
    def _load(self, path: Path) -> Any:
        if path not in self._cache:
            self._cache[path] = safe_load(path, trust_pickles=self.trust_pickles)
        return self._cache[path]

    def _optim(self, rank: int) -> dict:
        state = self._load(self.optim_files[rank])
        if "optimizer_state_dict" not in state or "zero_stage" not in state["optimizer_state_dict"]:
            raise ValueError(f"{self.optim_files[rank]} is not a ZeRO optimizer-states file (no zero_stage)")
        return state["optimizer_state_dict"]

    def _flat_groups(self, rank: int) -> list:
        optim = self._optim(rank)
        key = "fp32_flat_groups" if int(optim["zero_stage"]) == 3 else "single_partition_of_fp32_groups"
        groups = list(optim[key])
        for g, path in enumerate(self._swap_files(rank, groups)):
            if path is not None:
                groups[g] = _read_swap_file(path, self._sub_group_sizes[g])
        return groups

    def check_swap_files(self) -> None:
        """Every rank's ZeRO-Infinity swap files present and as long as the partitions its optimizer file records
        (FileNotFoundError / ValueError naming the file); nothing to check without swapped sub-groups."""
        for rank in range(self.world_size):
            optim = safe_load(self.optim_files[rank], trust_pickles=self.trust_pickles, meta=True)[
                "optimizer_state_dict"
            ]
            if int(optim["zero_stage"]) == 3:
                groups = list(optim["fp32_flat_groups"])
                self._swap_files(rank, groups)
                inner = optim.get("optimizer_state_dict")
                states = inner.get("state") if isinstance(inner, dict) else None
                self._moment_swap_files(rank, groups, states if isinstance(states, dict) else {})

    def _moment_swap_files(self, rank: int, groups: list, states: dict) -> list[Path]:
        """The optimizer moments of ``rank``'s swapped sub-groups: DeepSpeed's swapper writes each tensor of the
        sub-group's Adam state (``exp_avg``, ``exp_avg_sq``; its saved placeholder has a dimension, unlike ``step``)
        to ``<state>-<ds_id>.tensor.swp``, fp32, as long as the master partition, and reads it back on resume with
        its aio reader, which aborts the process on a short file. Each must be there and that long (FileNotFoundError
        / ValueError naming it)."""
        import torch

        folder = self._data
        out: list[Path] = []
        for g, tensor in enumerate(groups):
            ds_id = getattr(tensor, "ds_id", None)
            state = states.get(g)
            if tensor.numel() or ds_id is None or self.stage != 3 or not isinstance(state, dict):
                continue
            for key, value in state.items():
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    continue
                name = f"offloaded_tensors/rank{rank:02d}/{key}-{ds_id}.tensor.swp"  # key, ds_id: unpickled values
                out.append(self._checked_swap_file(folder, rank, g, name, f"optimizer state {key!r}"))
        return out

    def _checked_swap_file(self, folder: ConfinedFolder, rank: int, g: int, name: str, what: str) -> Path:
        """``name`` (built from unpickled values) confined to the checkpoint, present, and at least sub-group ``g``'s
        fp32 size: DeepSpeed's aio reader aborts the rank on a short file (FileNotFoundError / ValueError naming it)."""
        path = folder.path(name, named_in=self.optim_files[rank])
        if not path.is_file():
            raise FileNotFoundError(
                f"{self.optim_files[rank].name} has no fp32 {what} for sub-group {g} (ZeRO-Infinity swapped it to "
                f"NVMe) and {path} is missing: copy the complete checkpoint folder, offloaded_tensors/ included"
            )
        expected = self._sub_group_sizes[g] * 4 if g < len(self._sub_group_sizes) else None
        if expected is None or path.stat().st_size < expected:
            raise ValueError(
                f"{path} holds {path.stat().st_size} bytes, less than sub-group {g}'s fp32 {what} "
                f"({expected if expected is not None else 'unknown'} bytes): a truncated copy, or swap files of "
                "another checkpoint (its sub_group_size differs); copy the complete checkpoint folder again"
            )
        return path

    def _swap_files(self, rank: int, groups: list) -> list[Path | None]:
        """Per flat group of ``rank``: the NVMe swap file holding its fp32 partition, or None when it is stored inline."""
        folder = self._data
        out: list[Path | None] = []
        for g, tensor in enumerate(groups):
            ds_id = getattr(tensor, "ds_id", None)
            if tensor.numel() or ds_id is None or self.stage != 3:
                out.append(None)
                continue
            name = f"offloaded_tensors/rank{rank:02d}/{ds_id}.tensor.swp"  # ds_id: a value unpickled from the file
            path = self._checked_swap_file(folder, rank, g, name, "partition")
            out.append(path)
        return out

    def _flat_group_offsets(self, rank: int) -> list[tuple[str, int] | None]:
        """(file, offset) of each flat fp32 group of ``rank`` (None: not stored as one contiguous fp32 run)."""
        import torch

        if rank not in self._group_offsets:
            optim = safe_load(self.optim_files[rank], trust_pickles=self.trust_pickles, meta=True)[
                "optimizer_state_dict"
            ]
            key = "fp32_flat_groups" if int(optim["zero_stage"]) == 3 else "single_partition_of_fp32_groups"
            groups, path = optim[key], str(self.optim_files[rank])
            self._group_offsets[rank] = [
                (str(swap), 0) if swap is not None
                else (path, t.untyped_storage()._checkpoint_offset + t.storage_offset() * 4)
                if t.dtype == torch.float32 and t.is_contiguous() else None
                for t, swap in zip(groups, self._swap_files(rank, groups), strict=True)
            ]  # fmt: skip
        return self._group_offsets[rank]

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        source = self._sources.get(name)
        if source is None or source.frozen:
            return None
        remaining = math.prod(source.shape) * 4  # fp32 master weights
        ranges = []
        for piece in source.pieces:
            where = self._flat_group_offsets(piece.rank)[piece.group]
            if where is None:
                return None
            length = min(piece.length * 4, remaining)  # ZeRO-3 pads the last rank's piece
            if length > 0:
                ranges.append((where[0], where[1] + piece.start * 4, length))
            remaining -= length
        return ranges if remaining == 0 else None

    def release(self) -> None:
        self._cache.clear()

    # -- reading ------------------------------------------------------------------------------
    def read(self, names: list[str]) -> dict[str, Any]:
        return {name: self._read_one(name) for name in names}

    def _read_one(self, name: str):
        import torch

        if name in self._buffer_names:
            return self._load(self.model_file0)["module"][name].clone()
        source = self._sources[name]
        numel = math.prod(source.shape)
        if source.frozen:
            return self._read_frozen(name, source, numel)
        parts = [self._flat_groups(p.rank)[p.group].narrow(0, p.start, p.length) for p in source.pieces]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        return flat[:numel].view(source.shape)

    def _read_frozen(self, name: str, source: ParamSource, numel: int):
        import torch

        if self.stage < 3:
            return self._load(self.model_file0)["frozen_param_fragments"][name].clone().view(source.shape)
        parts = [self._load(f)["frozen_param_fragments"][name].reshape(-1) for f in self.model_files]
        return torch.cat(parts)[:numel].view(source.shape)


def zero3_sub_groups(param_shapes: list, world_size: int, sub_group_size: int | None) -> list[int]:
    """Per-rank elements of each ZeRO-3 sub-group, in ``fp32_flat_groups`` order: each param group cut once its
    params' partitions reach ``sub_group_size`` elements (deepspeed stage3.py ``_create_fp16_sub_groups``)."""
    sizes = []
    for shapes in param_shapes:
        parts = [math.ceil(math.prod(shape) / world_size) for shape in dict(shapes).values()]
        if not sub_group_size or sub_group_size >= sum(parts):
            sizes.append(sum(parts))
            continue
        run = 0
        for i, part in enumerate(parts):
            run += part
            if run >= sub_group_size or i == len(parts) - 1:
                sizes.append(run)
                run = 0
    return sizes


def _read_swap_file(path: Path, numel: int):
    """The first ``numel`` fp32 values of a ZeRO-Infinity swap file (raw, no header)."""
    import torch

    return torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32)


def _split_range(rank: int, start: int, length: int, bounds: list[int]) -> list[Piece]:
    """Pieces of ``[start, start+length)`` of one rank's concatenated groups (a param may straddle two)."""
    pieces = []
    pos, end = start, start + length
    for g in range(len(bounds) - 1):
        lo, hi = max(pos, bounds[g]), min(end, bounds[g + 1])
        if lo < hi:
            pieces.append(Piece(rank, g, lo - bounds[g], hi - lo))
    return pieces


def _train_dtype(ds_config: dict, from_file_prefix: str | None) -> str:
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled"):
        return "bf16"
    if (ds_config.get("fp16") or {}).get("enabled"):
        return "fp16"
    return from_file_prefix or "fp32"
