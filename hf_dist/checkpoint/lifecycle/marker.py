"""Complete-checkpoint markers: a ``checkpoint-N`` folder is trusted only once every rank finished writing it.

The Trainer writes ``checkpoint-N/`` from every rank without a final barrier, and rank 0 can be
done long before the others. A job killed in that window leaves a folder that looks finished
(``trainer_state.json`` is there) but lacks another rank's optimizer shard or RNG state.
:class:`hf_dist.callbacks.resume.CompleteCheckpointCallback` waits for every rank after the save and only
then has rank 0 write ``hf_dist_complete.json`` (atomically, :func:`write_marker`) listing every file and its
size. :func:`incomplete_reasons` / :func:`is_complete` check a folder against its marker and its
per-rank files (:meth:`hf_dist.checkpoint.formats.layout.CheckpointLayout.missing_rank_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_write_json
from hf_dist.checkpoint.formats.layout import (
    MARKER_NAME,
    TRAINER_STATE,
    WRITING_NAME,
    dcp_folders_without_metadata,
    read_layout,
)
from hf_dist.planning.layout import CheckpointFamily

MARKER_VERSION = 1
# WRITING_NAME: a save whose files a background thread is still writing (async_save); removed just before the
# marker is written. Both names are the layout's (hf_dist.checkpoint.formats.layout).


def mark_writing(checkpoint_dir: str | os.PathLike, step: int) -> None:
    """Say that ``checkpoint_dir``'s files are being written in the background: it proves nothing until marked."""
    atomic_write_json(Path(checkpoint_dir) / WRITING_NAME, {"step": step, "time": time.time()})


def clear_writing(checkpoint_dir: str | os.PathLike) -> None:
    (Path(checkpoint_dir) / WRITING_NAME).unlink(missing_ok=True)


def _relative_files(folder: Path) -> list[str]:
    names = (MARKER_NAME, WRITING_NAME)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name not in names)


def missing_rank_files(checkpoint_dir: str | os.PathLike, world_size: int) -> list[str]:
    """Per-rank files absent for some rank, e.g. ``['rng state of rank 1']``; empty when all ranks wrote."""
    return read_layout(checkpoint_dir, strict=False).missing_rank_files(world_size)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_marker(
    checkpoint_dir: str | os.PathLike,
    *,
    world_size: int = 1,
    strategy: str | None = None,
    step: int | None = None,
    checksums: bool = False,
) -> dict:
    """Write ``hf_dist_complete.json`` atomically into ``checkpoint_dir``; call only after every rank saved.

    Raises RuntimeError (and writes nothing) when a rank's files are missing.
    """
    folder = Path(checkpoint_dir)
    layout = read_layout(folder, strict=False)
    missing = layout.missing_rank_files(world_size)
    if missing:
        raise RuntimeError(
            f"{folder} is not complete: missing {', '.join(missing)} (world size {world_size}); "
            "not marking it complete, so auto_resume will skip it"
        )
    entries = {}
    for rel in _relative_files(folder):
        entry: dict[str, Any] = {"size": (folder / rel).stat().st_size}
        if checksums:
            entry["sha256"] = _sha256(folder / rel)
        entries[rel] = entry
    marker = {
        "version": MARKER_VERSION,
        "step": step,
        "world_size": world_size,
        "strategy": strategy,
        "layout": layout.family.value,
        "time": time.time(),
        "files": entries,
    }
    atomic_write_json(folder / MARKER_NAME, marker, indent=1, sort_keys=True)
    return marker


def incomplete_reasons(checkpoint_dir: str | os.PathLike, *, checksums: bool = False) -> list[str]:
    """Why ``checkpoint_dir`` cannot be trusted; an empty list means it is complete."""
    folder = Path(checkpoint_dir)
    marker_path = folder / MARKER_NAME
    if not marker_path.is_file():
        return [f"no {MARKER_NAME} (the save did not finish on every rank)"]
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError) as exc:
        return [f"unreadable {MARKER_NAME}: {exc}"]
    problem = _malformed_marker(marker)
    if problem:
        return [f"malformed {MARKER_NAME}: {problem}"]
    reasons = []
    for rel, entry in marker["files"].items():
        path = folder / rel
        if not path.is_file():
            reasons.append(f"{rel} is missing")
        elif path.stat().st_size != entry["size"]:
            reasons.append(f"{rel} has {path.stat().st_size} bytes, the marker says {entry['size']}")
        elif checksums and "sha256" in entry and _sha256(path) != entry["sha256"]:
            reasons.append(f"{rel} checksum differs from the marker")
    # the marker's list is not trusted to be whole: every rank's files must be on disk
    reasons += [f"{what} is missing" for what in missing_rank_files(folder, marker.get("world_size") or 1)]
    if not marker["files"] and _relative_files(folder):
        reasons.append(f"{MARKER_NAME} lists no files but the folder holds {len(_relative_files(folder))}")
    return reasons


def _malformed_marker(marker: Any) -> str | None:
    """What is wrong with a parsed marker's structure, or None."""
    if not isinstance(marker, dict):
        return f"expected a JSON object, got {type(marker).__name__}"
    files = marker.get("files")
    if not isinstance(files, dict):
        return f'"files" must be an object of path -> {{"size": bytes}}, got {type(files).__name__}'
    world = marker.get("world_size", 1)
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        return f'"world_size" must be a positive integer, got {world!r}'
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"the entry of {rel} has no integer size ({entry!r})"
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"the entry {rel!r} points outside the checkpoint"
    return None


def is_complete(checkpoint_dir: str | os.PathLike, *, checksums: bool = False) -> bool:
    """True when every rank finished writing ``checkpoint_dir`` and no listed file changed size since."""
    return not incomplete_reasons(checkpoint_dir, checksums=checksums)


def unmarked_reasons(checkpoint_dir: str | os.PathLike, world_size: int) -> list[str]:
    """Why a ``checkpoint-N`` without hf_dist's marker (a run without hf_dist's callbacks) cannot be proven complete
    from the Trainer's own files; an empty list means it is proven.

    The proof: ``trainer_state.json`` (the Trainer writes it after the model, optimizer, scheduler and RNG state)
    names step N; every per-rank file of the layout is there (full weights: for ``world_size`` ranks, the live
    run's, or more if the files name more; sharded files name the ranks that wrote them); every DCP folder has the
    ``.metadata`` DCP writes once all ranks finished; no file is empty; safetensors files hold every byte their
    header promises. Without the marker's barrier, a rank that died after rank 0 wrote ``trainer_state.json`` is
    caught by its missing files.
    """
    folder = Path(checkpoint_dir)
    if (folder / WRITING_NAME).is_file():
        return [
            f"{WRITING_NAME}: its files were still being written in the background (async_save) when the run stopped"
        ]
    reasons = _trainer_state_reasons(folder)
    layout = read_layout(folder, strict=False)
    # Sharded files name the ranks that wrote them (and may be resumed on another count); full weights do not.
    ranks = layout.world_size or 1
    if layout.family is CheckpointFamily.FULL:
        ranks = max(world_size, ranks)
    reasons += [f"{what} is missing" for what in layout.missing_rank_files(ranks)]
    for sub in dcp_folders_without_metadata(folder):
        reasons.append(f"{sub.relative_to(folder)}/.metadata is missing (DCP writes it once every rank finished)")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if path.stat().st_size == 0:
            reasons.append(f"{rel} is empty")
        elif path.suffix == ".safetensors" and (problem := _safetensors_truncated(path)):
            reasons.append(f"{rel} {problem}")
    return reasons


def _trainer_state_reasons(folder: Path) -> list[str]:
    path = folder / TRAINER_STATE
    if not path.is_file():
        return ["trainer_state.json is missing (the Trainer writes it after every other file of the save)"]
    try:
        step = json.loads(path.read_text()).get("global_step")
    except (OSError, ValueError, AttributeError) as exc:
        return [f"trainer_state.json is unreadable ({exc})"]
    expected = folder.name.rpartition("-")[2]
    if str(step) != expected:
        return [f"trainer_state.json says global_step {step}, the folder name {expected}"]
    return []


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
