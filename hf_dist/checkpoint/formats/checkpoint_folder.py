"""One checkpoint, opened once: its folder, the layout found in it and its manifest, in one object that never changes.

:func:`open_checkpoint` is where ``convert``, ``verify``, ``reshard``, ``auto_resume``, the proof of a checkpoint
without a manifest and the best-model check start. It reads the layout (:func:`read_contents`) and parses the manifest
(:func:`load_manifest`, the one parser of ``hf_dist_complete.json``) once, and every check after it takes the object:

- ``files``: the :class:`~hf_dist.checkpoint.safety.paths.ConfinedFolder` of the checkpoint's root, the way to its
  files (:meth:`CheckpointFolder.path`; ``data``: the folder holding the tensors, the one the readers are given);
- ``contents``: the :class:`~hf_dist.checkpoint.formats.contents.CheckpointContents` found there;
- ``manifest``: a :class:`Manifest`: parsed and well formed, absent, or why it cannot be used (unreadable, a link out,
  malformed), so no caller parses or shape-checks it again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from hf_dist.checkpoint.formats.contents import CheckpointContents, read_contents
from hf_dist.checkpoint.formats.names import MANIFEST_NAME
from hf_dist.checkpoint.safety.paths import ConfinedFolder, PathEscapeError, confined

MANIFEST_VERSION = 2
# An hf_dist before the manifest wrote version 1: sizes only, no run, kept readable as "no manifest".
SIZE_ONLY_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest as parsed once: ``data`` when it is there and well formed, ``problem`` (one line)
    when it is there but cannot be used; both None when the folder has none."""

    data: dict | None = None
    problem: str | None = None

    @property
    def present(self) -> bool:
        return self.data is not None or self.problem is not None

    @property
    def judged(self) -> bool:
        """True when the folder is judged by its manifest: one of this version, or one that cannot be used (refused
        as a manifest). False with none, or with an older hf_dist's size-only marker (then the proof judges)."""
        return self.problem is not None or (self.data is not None and self.data.get("version") != SIZE_ONLY_VERSION)

    @property
    def run(self) -> str | None:
        """The run that wrote the save, when the manifest names one."""
        run = self.data.get("run") if self.data is not None else None
        return run if isinstance(run, str) else None


def load_manifest(files: ConfinedFolder | str | os.PathLike) -> Manifest:
    """The manifest of a folder (its folder object, or its path), parsed and shape-checked: the one parser of the
    file."""
    files = files if isinstance(files, ConfinedFolder) else ConfinedFolder(Path(files))
    try:
        path = files.path(MANIFEST_NAME)
    except PathEscapeError as exc:
        return Manifest(problem=f"unreadable {MANIFEST_NAME}: {exc}")
    if not path.is_file():
        return Manifest()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nesting past the parser's depth
        return Manifest(problem=f"unreadable {MANIFEST_NAME}: {type(exc).__name__}: {str(exc)[:200]}")
    problem = malformed(data)
    return Manifest(problem=f"malformed {MANIFEST_NAME}: {problem}") if problem else Manifest(data=data)


def malformed(manifest: Any) -> str | None:
    """What is wrong with a parsed manifest's structure, or None."""
    if not isinstance(manifest, dict):
        return f"expected a JSON object, got {type(manifest).__name__}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f'"files" must be an object of path -> {{"size", "sha256"}}, got {type(files).__name__}'
    world = manifest.get("world_size", 1)
    if world is not None and (not isinstance(world, int) or isinstance(world, bool) or world < 1):
        return f'"world_size" must be a positive integer, got {world!r}'
    for rel, entry in files.items():
        size = entry.get("size") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f"the entry of {rel} has no integer size ({entry!r})"
        if PurePath(rel).is_absolute() or ".." in PurePath(rel).parts:
            return f"the entry {rel!r} points outside the checkpoint"
        if manifest.get("version") == MANIFEST_VERSION and not isinstance(entry.get("sha256"), str):
            return f"the entry of {rel} has no sha256"
    return None


@dataclass(frozen=True)
class CheckpointFolder:
    """A checkpoint opened by :func:`open_checkpoint`: its root folder (``files``), the layout found in it
    (``contents``) and its manifest (``manifest``), read once and never changed."""

    files: ConfinedFolder
    contents: CheckpointContents
    manifest: Manifest

    @property
    def root(self) -> Path:
        return self.files.root

    @property
    def data(self) -> ConfinedFolder:
        """The folder holding the tensors (a DeepSpeed tag or DCP folder, the root, or the folder of a weights file)
        as a folder object confined to the checkpoint's root: the readers reach every file through it."""
        path = self.contents.path
        return ConfinedFolder(confined(path if path.is_dir() else path.parent, self.root), self.root)

    def path(self, name: object, *, named_in: str | os.PathLike | None = None) -> Path:
        """The file ``name`` of the checkpoint, refused when it leaves the folder (see ``ConfinedFolder.path``)."""
        return self.files.path(name, named_in=named_in)


def open_checkpoint(path: str | os.PathLike, *, tag: str | None = None, strict: bool = True) -> CheckpointFolder:
    """The checkpoint at ``path`` (a folder, or a weights file), its layout read and its manifest parsed once.

    ``strict=False`` (resume bookkeeping, which must answer for any ``checkpoint-N`` folder) never refuses a folder
    for holding no readable weights (:func:`read_contents`). A link leading out is refused either way."""
    contents = read_contents(path, tag=tag, strict=strict)
    files = ConfinedFolder(contents.root)
    return CheckpointFolder(files, contents, load_manifest(files))


def as_checkpoint(checkpoint: CheckpointFolder | str | os.PathLike) -> CheckpointFolder:
    """``checkpoint`` itself when it was opened already, else the folder opened leniently (``strict=False``)."""
    if isinstance(checkpoint, CheckpointFolder):
        return checkpoint
    return open_checkpoint(checkpoint, strict=False)
