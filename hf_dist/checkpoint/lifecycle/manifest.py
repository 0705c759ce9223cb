"""A checkpoint is complete only when its manifest, written last, lists exactly what is on disk.

``hf_dist_complete.json`` is the manifest of one save: every file of ``checkpoint-N/`` with its size and SHA-256,
the run and the save that wrote it, the world size and strategy. It is written by rank 0 after every rank finished
writing (:class:`hf_dist.callbacks.resume.CompleteCheckpointCallback`; each rank hashes the files it wrote, in the
background for ``async_save``), and it is the last file of the save. Before a save writes its first file into a
``checkpoint-N`` folder, :func:`begin_save` removes that folder's old manifest (an atomic unlink) and leaves a
pending-write note naming the save, so a save that dies half way leaves a folder that proves nothing.

:func:`incomplete_reasons` compares a folder with its manifest: a listed file missing, of another size or other
content, a file not listed, a pending-write note of another save. A folder without a manifest (a plain Trainer
run, an older hf_dist's size-only marker) is proved from the layout of what its strategy writes
(:func:`hf_dist.checkpoint.lifecycle.proof.unproven_reasons`): every file present and readable, or it is skipped with
the reason. The file is parsed in one place, when the checkpoint is opened
(:func:`hf_dist.checkpoint.formats.checkpoint_folder.load_manifest`).

Cost of the content hash: SHA-256 reads every byte once, about 2.3 s per GiB on one core of the 2-core CI machine
(measured while other jobs ran, docs/fault-tolerance.md); every rank hashes its own files, so a save's hashing
time is its largest rank's share.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from hf_dist.atomic_io import atomic_write_json
from hf_dist.checkpoint.formats.checkpoint_folder import (
    MANIFEST_VERSION,
    CheckpointFolder,
    Manifest,
    as_checkpoint,
    load_manifest,
)
from hf_dist.checkpoint.formats.contents import CheckpointContents, read_contents
from hf_dist.checkpoint.formats.names import (
    LATEST,
    LATEST_UNIVERSAL,
    MANIFEST_NAME,
    OUTPUT_MARKER,
    UNIVERSAL_SUFFIX,
    WRITING_NAME,
    owner_rank,
)
from hf_dist.checkpoint.safety.paths import ConfinedFolder, PathEscapeError, is_inside


def new_id() -> str:
    """A run's or a save's identity in manifests and notes."""
    return uuid.uuid4().hex[:16]


# ---------------------------------------------------------------- files and hashes


def hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def entries(folder: Path, rels: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{rel: {"size", "sha256"}}`` of files of ``folder``."""
    out, files = {}, ConfinedFolder(Path(folder))
    for rel in rels:
        path = files.path(rel)
        out[rel] = {"size": path.stat().st_size, "sha256": hash_file(path)}
    return out


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and (".tmp" in name or ".old-" in name)


def _is_derived(rel: Path) -> bool:
    """A universal copy ``hf-dist reshard`` made beside the save (``<tag>_universal/``, ``latest_universal``): not
    what the run saved; the copy has a manifest of its own."""
    return rel.parts[0].endswith(UNIVERSAL_SUFFIX) or rel.as_posix() == LATEST_UNIVERSAL


def checkpoint_files(folder: Path) -> list[str]:
    """Every file of ``folder`` a manifest lists: all but the manifest, the pending-write note, hf_dist's output label
    (a resharded copy carries one), temporaries and derived universal copies.

    Exactly what the loaders read: links are followed (a linked tag folder's files are listed under the link's name,
    and hashed through it) when they stay inside ``folder``; a link that leaves it, or leads nowhere, is refused
    (:class:`~hf_dist.checkpoint.safety.paths.PathEscapeError`, naming the link and its target). The folder DeepSpeed's
    ``latest`` names is listed whatever its name (``latest`` naming a hidden or temporary folder is refused by
    :func:`~hf_dist.checkpoint.safety.paths.checked_tag` when it is read)."""
    folder = Path(folder)
    root, kept = ConfinedFolder(folder), _latest_named(folder)
    out: list[str] = []
    for top, dirs, files in os.walk(folder, followlinks=True):
        rel_top = PurePosixPath(Path(top).relative_to(folder).as_posix())  # names listed here, relative to the root
        for name in list(dirs):
            sub = _listed(root, rel_top.joinpath(name))
            loops = sub.is_symlink() and is_inside(top, sub)  # a link to a folder around it: walked already
            if loops or _skipped(rel_top.joinpath(name), kept):
                dirs.remove(name)
        for name in files:
            rel = rel_top.joinpath(name)
            path = _listed(root, rel)
            if not path.is_file() or _skipped(rel, kept):
                continue
            if rel_top == PurePosixPath(".") and name in (MANIFEST_NAME, WRITING_NAME, OUTPUT_MARKER):
                continue
            out.append(rel.as_posix())
    return sorted(out)


def _listed(root: ConfinedFolder, rel: PurePosixPath) -> Path:
    """The path of a name listed under ``root``; a link that leaves it, or leads nowhere, raises PathEscapeError."""
    path = root.path(rel.as_posix())
    if path.is_symlink() and not path.exists():
        raise PathEscapeError(
            f"refusing to read {path}: it is a broken link (to {os.readlink(path)}); a checkpoint may only name files "
            "inside its own folder. Remove the link or copy its target in"
        )
    return path


def _latest_named(folder: Path) -> set[str]:
    """The folder name DeepSpeed's ``latest`` names, raw (checked where it is read): listed, never skipped. The file
    is small by construction; more than 4 KiB is no tag."""
    try:
        path = ConfinedFolder(folder).path(LATEST)
        if not path.is_file() or path.stat().st_size > 4096:
            return set()
        tag = path.read_text(errors="replace").strip()
    except OSError:
        return set()
    return {tag} if tag and "/" not in tag and tag not in (".", "..") else set()


def _skipped(rel: Path, kept: set[str] | frozenset[str] = frozenset()) -> bool:
    """A temporary or derived name, unless it is the folder ``latest`` names (``kept``): that one is listed."""
    if rel.parts and rel.parts[0] in kept:
        return any(_is_temporary(part) for part in rel.parts[1:])
    return any(_is_temporary(part) for part in rel.parts) or _is_derived(rel)


def own_files(folder: Path, rank: int, world_size: int) -> list[str]:
    """The files of ``folder`` that ``rank`` hashes: those of its rank (by name), and on rank 0 every file of no
    rank or of a rank beyond the world: the ranks hash in parallel, each what it wrote."""
    out = []
    for rel in checkpoint_files(folder):
        owner = owner_rank(rel)
        if owner == rank or (rank == 0 and (owner is None or owner >= world_size)):
            out.append(rel)
    return out


# ---------------------------------------------------------------- writing


def begin_save(folder: Path, *, step: int, run: str | None, save: str) -> None:
    """Rank 0, before any rank writes a file of this save: the old manifest goes (one unlink: the folder proves
    nothing from now on), then a note names the save under way."""
    files = ConfinedFolder(Path(folder))
    files.path(MANIFEST_NAME).unlink(missing_ok=True)
    atomic_write_json(files.path(WRITING_NAME), {"step": step, "run": run, "save": save, "time": time.time()})


def write_manifest(
    folder: Path,
    *,
    hashed: dict[str, dict[str, Any]],
    world_size: int,
    step: int | None = None,
    run: str | None = None,
    save: str | None = None,
    strategy: str | None = None,
) -> dict:
    """Rank 0, after every rank finished: the manifest of everything in ``folder`` (``hashed``: entries the ranks
    computed; the rest is hashed here), written atomically; then the note goes. Raises RuntimeError, writing
    nothing, when a rank's files are missing."""
    folder = Path(folder)
    layout = read_contents(folder, strict=False)
    missing = layout.missing_rank_files(world_size)
    if missing:
        raise RuntimeError(
            f"{folder} is not complete: missing {', '.join(missing)} (world size {world_size}); not writing its "
            "manifest, so auto_resume will skip it"
        )
    files = checkpoint_files(folder)
    listed = {rel: hashed[rel] for rel in files if rel in hashed}
    listed.update(entries(folder, [rel for rel in files if rel not in hashed]))
    manifest = {
        "version": MANIFEST_VERSION,
        "step": step,
        "run": run,
        "save": save,
        "world_size": world_size,
        "strategy": strategy,
        "layout": layout.family.value,
        "time": time.time(),
        "files": listed,
    }
    own = ConfinedFolder(folder)
    atomic_write_json(own.path(MANIFEST_NAME), manifest, indent=1, sort_keys=True)
    own.path(WRITING_NAME).unlink(missing_ok=True)
    return manifest


def extend_manifest(folder: Path, rels: Iterable[str]) -> None:
    """Rank 0: add files written into a complete checkpoint after its manifest (an export) to that manifest."""
    files = ConfinedFolder(Path(folder))
    manifest = load_manifest(files).data
    if manifest is None or manifest.get("version") != MANIFEST_VERSION:
        return
    manifest["files"].update(entries(files.root, rels))
    atomic_write_json(files.path(MANIFEST_NAME), manifest, indent=1, sort_keys=True)


# ---------------------------------------------------------------- reading


def incomplete_reasons(
    checkpoint: CheckpointFolder | str | os.PathLike, *, files: Iterable[str] | None = None
) -> list[str]:
    """Why the checkpoint (opened, or a folder to open) does not match its manifest; empty when it does (``files``:
    hash only these, when ranks share the work; everything else is still checked). A folder without a manifest is not
    complete here."""
    checkpoint = as_checkpoint(checkpoint)
    reasons = _disagreements(checkpoint.files, checkpoint.manifest, checkpoint.contents, files)
    return reasons if checkpoint.manifest.data is None else reasons + _derived_reasons(checkpoint.files)


def _disagreements(
    listed: ConfinedFolder, manifest: Manifest, contents: CheckpointContents, files: Iterable[str] | None
) -> list[str]:
    """What differs between the folder ``listed`` and its parsed ``manifest``."""
    if manifest.problem is not None:
        return [manifest.problem]
    if manifest.data is None:
        return [f"no {MANIFEST_NAME} (the save did not finish on every rank)"]
    folder, data = listed.root, manifest.data
    reasons = _note_reasons(listed, data)
    on_disk = set(checkpoint_files(folder))
    hash_these = set(on_disk if files is None else files)
    for rel, entry in data["files"].items():
        path = listed.path(rel, named_in=listed.path(MANIFEST_NAME))
        if rel not in on_disk:
            reasons.append(f"{rel} is missing")
        elif path.stat().st_size != entry["size"]:
            reasons.append(f"{rel} has {path.stat().st_size} bytes, the manifest says {entry['size']}")
        elif "sha256" in entry and rel in hash_these and hash_file(path) != entry["sha256"]:
            reasons.append(f"{rel} differs from the manifest (SHA-256; same size, other content)")
    unlisted = sorted(on_disk - set(data["files"]))
    if unlisted:
        reasons.append(f"{', '.join(unlisted[:3])}{' ...' if len(unlisted) > 3 else ''} not in the manifest "
                       "(written after it: another save or another run)")  # fmt: skip
    return reasons + [f"{what} is missing" for what in contents.missing_rank_files(data.get("world_size") or 1)]


def _derived_reasons(root: ConfinedFolder) -> list[str]:
    """A universal copy beside the save is checked against its own manifest (one without: an unchecked copy)."""
    reasons = []
    for sub in sorted(p for p in root.root.iterdir() if p.is_dir() and p.name.endswith(UNIVERSAL_SUFFIX)):
        copy = root.folder(sub.name)
        found = load_manifest(copy)
        if not found.present:
            reasons.append(f"{sub.name}/ has no {MANIFEST_NAME} (a universal copy hf_dist did not make)")
            continue
        contents = read_contents(copy.root, strict=False)
        reasons += [f"{sub.name}/{reason}" for reason in _disagreements(copy, found, contents, None)]
        if found.data is not None:
            reasons += [f"{sub.name}/{reason}" for reason in _derived_reasons(copy)]
    return reasons


def _note_reasons(folder: ConfinedFolder, manifest: dict) -> list[str]:
    note_path = folder.path(WRITING_NAME)
    if not note_path.is_file():
        return []
    try:
        note = json.loads(note_path.read_text())
    except (OSError, ValueError):
        note = {}
    if isinstance(note, dict) and note.get("save") and note.get("save") == manifest.get("save"):
        return []  # the save that wrote the manifest; its note's removal was cut short
    return [
        f"{WRITING_NAME}: a later save (step {note.get('step') if isinstance(note, dict) else '?'}) began writing "
        "into this folder after the manifest and did not finish: its files and the manifest's are mixed"
    ]


def require_match(checkpoint: CheckpointFolder | str | os.PathLike) -> None:
    """Refuse a checkpoint whose manifest does not match the disk (``convert``, ``verify``, ``reshard`` read only
    what was written); a folder without a manifest passes (its reader checks what it reads)."""
    from hf_dist.checkpoint.safety.errors import CorruptCheckpointError

    if not isinstance(checkpoint, CheckpointFolder) and not Path(checkpoint).is_dir():
        return
    checkpoint = as_checkpoint(checkpoint)
    if not checkpoint.root.is_dir() or not checkpoint.manifest.judged:
        return
    reasons = incomplete_reasons(checkpoint)
    if reasons:
        raise CorruptCheckpointError(
            f"{checkpoint.root} does not match its {MANIFEST_NAME}: {'; '.join(reasons[:3])}"
            f"{' ...' if len(reasons) > 3 else ''}. It changed after it was written, or the copy is partial: re-copy "
            "it, or use an earlier checkpoint"
        )


def is_complete(checkpoint: CheckpointFolder | str | os.PathLike) -> bool:
    """True when the checkpoint's manifest lists exactly what is on disk (sizes and content)."""
    return not incomplete_reasons(checkpoint)
