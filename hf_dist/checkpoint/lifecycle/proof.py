"""A checkpoint without a manifest (a plain Trainer run, an older hf_dist), proved complete from what its strategy
writes, or not at all.

:func:`unproven_reasons` asks the layout model (:func:`hf_dist.checkpoint.formats.contents.read_contents`) which family
the folder is and checks that every file that family's save writes is there and readable:

- always: ``trainer_state.json`` naming step N (the Trainer writes it after every other file of the save), the
  LR scheduler (``scheduler.pt``, or hf_dist's ``hf_dist_scheduler.json`` for a model sharded at load), every
  rank's RNG state;
- full weights (DDP, one process): the weights and ``optimizer.pt`` (or hf_dist's ``hf_dist_optimizer/`` DCP folder
  for a model sharded at load), else Adam would restart from zero;
- DeepSpeed ZeRO: ``latest`` naming a tag folder that holds the model states and every rank's optimizer partition,
  and each rank's ZeRO-Infinity swap files of the length its partition needs;
- FSDP (DCP): ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, each with the ``.metadata`` DCP writes once every
  rank finished, and every rank's shards;
- readable: no file empty, safetensors as long as their header says, every pickle a resume loads loaded with the
  safe loader (tensors on the meta device; :func:`hf_dist.checkpoint.safety.loading.check_loadable`).

An older hf_dist's size-only marker (version 1) is read as what it is: sizes, checked, on top of this proof.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder, as_checkpoint
from hf_dist.checkpoint.formats.names import (
    DCP_METADATA,
    HF_WEIGHT_NAMES,
    LATEST,
    MANIFEST_NAME,
    OPTIMIZER_FILES,
    SCHEDULER_FILES,
    SHARDED_OPTIMIZER_DIR,
    SHARDED_SCHEDULER,
    WRITING_NAME,
    dcp_folders_without_metadata,
)
from hf_dist.checkpoint.formats.trainer_state import TrainerStateError, read_trainer_state
from hf_dist.planning.layout import CheckpointFamily


def unproven_reasons(checkpoint: CheckpointFolder | str | Path, world_size: int) -> list[str]:
    """Why the checkpoint (opened, or a folder to open; no manifest) cannot be proven complete; empty when every file
    its family writes is there and readable. ``world_size``: the ranks of the live run (full weights do not name the
    ranks that wrote them)."""
    checkpoint = as_checkpoint(checkpoint)
    folder, files, layout = checkpoint.root, checkpoint.files, checkpoint.contents
    if files.is_file(WRITING_NAME):
        return [f"{WRITING_NAME}: a save was writing into this folder and did not finish"]
    reasons = _trainer_state_reasons(folder) + _size_only_marker_reasons(checkpoint)
    ranks = layout.world_size or 1
    if layout.family is CheckpointFamily.FULL:
        ranks = max(world_size, ranks)
    if not layout.rank_files.get("rng state") and not files.is_file("rng_state.pth"):
        reasons.append("no rng_state*.pth (the Trainer saves every rank's random generators)")
    reasons += [f"{what} is missing" for what in layout.missing_rank_files(ranks)]
    reasons += _family_reasons(checkpoint)
    for sub in dcp_folders_without_metadata(folder):
        reasons.append(f"{sub.relative_to(folder)}/.metadata is missing (DCP writes it once every rank finished)")
    reasons += _unreadable_reasons(folder)
    return reasons


def _family_reasons(checkpoint: CheckpointFolder) -> list[str]:
    """The files a save of the checkpoint's family always writes, absent from its folder."""
    files, family = checkpoint.files, checkpoint.contents.family
    sharded_at_load = files.is_dir(SHARDED_OPTIMIZER_DIR)
    zero = files.is_file(LATEST) or family.is_zero
    reasons = []
    scheduled = any(files.is_file(name) for name in (*SCHEDULER_FILES, SHARDED_SCHEDULER))
    if not scheduled and not (zero and _deepspeed_holds_scheduler(checkpoint)):  # DeepSpeed's own scheduler: no file
        reasons.append("scheduler.pt is missing (the LR schedule would restart)")
    if zero:
        reasons += _zero_reasons(checkpoint)
    elif family is CheckpointFamily.DCP:
        for name in ("pytorch_model_fsdp_0", "optimizer_0"):
            if not files.is_file(f"{name}/{DCP_METADATA}"):
                reasons.append(f"{name}/{DCP_METADATA} is missing (FSDP's {name.split('_')[0]} state)")
    elif sharded_at_load:
        if not files.is_file(f"{SHARDED_OPTIMIZER_DIR}/{DCP_METADATA}"):
            reasons.append(f"{SHARDED_OPTIMIZER_DIR}/{DCP_METADATA} is missing (the TP optimizer state)")
    else:
        if not any(files.is_file(name) for name in HF_WEIGHT_NAMES):
            reasons.append("no model weights (model.safetensors, pytorch_model.bin or an adapter)")
        if not any(files.is_file(name) for name in OPTIMIZER_FILES):
            reasons.append("optimizer.pt is missing (Adam would restart from zero moments)")
    return reasons


def _deepspeed_holds_scheduler(checkpoint: CheckpointFolder) -> bool:
    """Whether DeepSpeed's own LR scheduler ran and saved its state in the model-states file: under a DeepSpeed
    config with a ``scheduler`` section the Trainer writes no ``scheduler.pt`` (transformers' ``_save_scheduler``).
    False where the files cannot be read: :func:`_zero_reasons` then says what is wrong with them."""
    from hf_dist.checkpoint.formats.deepspeed import DeepSpeedReader
    from hf_dist.checkpoint.safety.errors import CorruptCheckpointError, UnsafePickleError

    if checkpoint.contents.format != "deepspeed":
        return False
    try:
        return DeepSpeedReader(checkpoint).holds_scheduler  # the reader releases its files when built
    except (FileNotFoundError, ValueError, CorruptCheckpointError, UnsafePickleError):
        return False


def _zero_reasons(checkpoint: CheckpointFolder) -> list[str]:
    from hf_dist.checkpoint.formats.contents import latest_tag

    files = checkpoint.files
    if not files.is_file(LATEST):
        return [f"{LATEST} is missing (DeepSpeed names its tag folder there)"]
    tag = latest_tag(checkpoint.root)
    if not files.is_dir(tag) or not any(files.path(tag).glob("*_optim_states.pt")):
        return [f"{tag}/ is missing or holds no optimizer partitions ({LATEST} names it)"]
    if checkpoint.contents.unread is not None:
        return [checkpoint.contents.unread]
    return _swap_file_reasons(checkpoint)


def _swap_file_reasons(checkpoint: CheckpointFolder) -> list[str]:
    """ZeRO-Infinity: every rank's swap files as long as the partitions its optimizer file records."""
    if not checkpoint.data.is_dir("offloaded_tensors"):
        return []
    from hf_dist.checkpoint.formats.deepspeed import DeepSpeedReader

    try:
        reader = DeepSpeedReader(checkpoint)  # reading the partitions' index checks each swap file's length
        reader.check_swap_files()
        reader.release()
    except (FileNotFoundError, ValueError) as exc:
        return [str(exc)]
    return []


def _unreadable_reasons(folder: Path) -> list[str]:
    from hf_dist.checkpoint.safety.errors import CorruptCheckpointError
    from hf_dist.checkpoint.safety.loading import check_loadable

    reasons = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if path.stat().st_size == 0:
            reasons.append(f"{rel} is empty")
        elif path.suffix == ".safetensors" and (problem := _safetensors_truncated(path)):
            reasons.append(f"{rel} {problem}")
    if not reasons:
        try:
            check_loadable(folder)
        except CorruptCheckpointError as exc:
            reasons.append(str(exc))
    return reasons


def _trainer_state_reasons(folder: Path) -> list[str]:
    try:
        step = read_trainer_state(folder)["global_step"]
    except TrainerStateError as exc:
        return [str(exc)]
    expected = folder.name.rpartition("-")[2]
    if str(step) != expected:
        return [f"trainer_state.json says global_step {step}, the folder name {expected}"]
    return []


def _size_only_marker_reasons(checkpoint: CheckpointFolder) -> list[str]:
    """An older hf_dist's marker (version 1: sizes only): the sizes it lists, checked."""
    marker = checkpoint.manifest
    if marker.problem is not None:
        return [marker.problem]
    if marker.data is None:
        return []
    reasons = []
    listed = checkpoint.files
    for rel, entry in marker.data["files"].items():
        size = entry["size"]
        path = listed.path(rel, named_in=listed.path(MANIFEST_NAME))
        if not path.is_file():
            reasons.append(f"{rel} is missing")
        elif path.stat().st_size != size:
            reasons.append(f"{rel} has {path.stat().st_size} bytes, the marker says {size}")
    return reasons


def _safetensors_truncated(path: Path) -> str | None:
    """What is wrong with a safetensors file's length against its own header, or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if length <= 0 or 8 + length > size:
                return f"has a header of {length} bytes in a {size}-byte file"
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        return f"has an unreadable header ({exc})"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    needed = 8 + length + max(ends, default=0)
    return f"is truncated: {size} bytes, its header needs {needed}" if size < needed else None
