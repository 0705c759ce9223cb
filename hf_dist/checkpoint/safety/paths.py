"""Paths a checkpoint names stay inside that checkpoint: resolved by the OS (``realpath``), never by reading names.

A checkpoint folder someone hands over can point elsewhere in three ways: a symbolic link (a tag folder, a shard,
a swap file, at any depth) whose target is outside, a DeepSpeed ``latest``/``latest_universal`` file naming
``../elsewhere/global_stepN`` or an absolute path, and a DCP ``.metadata`` whose storage entries name
``../file.distcp``. Each is refused here, naming the path and where it leads:

- :func:`confined`: one path, resolved, must lie inside the root (every load hf_dist performs or drives asks it,
  :mod:`hf_dist.checkpoint.safety.loading`);
- :func:`check_tree_confined`: every entry under a root, links followed by ``realpath`` (run before a library is
  handed the folder, for what it opens without ``torch.load``: safetensors, swap files);
- :func:`checked_tag`: the text of a ``latest`` file is one folder name inside the root;
- :class:`ConfinedFolder`: the one way a name read from a file (an index's ``weight_map``, a manifest entry, a DCP
  storage entry, a ``latest`` tag, a ``ds_id``) becomes a path: ``ConfinedFolder(root).path(name, named_in=file)``
  refuses a name that is not a relative path below the root (``..``, absolute) and a link whose target leaves it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePath


class PathEscapeError(ValueError):
    """A path a checkpoint names resolves outside that checkpoint's folder."""


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.fspath(path))


def is_inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True when ``path``, every link resolved, is ``root`` or lies under it (``root`` resolved too)."""
    real, base = _real(path), _real(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def confined(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """``path`` itself when it resolves inside ``root``; else :class:`PathEscapeError` naming both."""
    if not is_inside(path, root):
        raise PathEscapeError(
            f"refusing to read {path}: it resolves to {_real(path)}, outside the checkpoint {root}; a checkpoint may "
            "only name files inside its own folder. Copy the files into the checkpoint or remove the link"
        )
    return Path(path)


def check_tree_confined(root: str | os.PathLike) -> None:
    """Refuse ``root`` when any link under it, at any depth, leads outside it (or nowhere)."""
    base = Path(root)
    for folder, dirs, files in os.walk(base, followlinks=False):
        for name in (*dirs, *files):
            entry = Path(folder) / name
            if entry.is_symlink():
                if not os.path.exists(entry):
                    raise PathEscapeError(
                        f"refusing to read {entry}: it is a broken link (to {os.readlink(entry)}); a checkpoint may "
                        "only name files inside its own folder. Remove the link or copy its target in"
                    )
                confined(entry, base)


def checked_tag(root: str | os.PathLike, text: str, source: str) -> str:
    """The tag a DeepSpeed ``latest`` file (``source``) names: one folder name, resolving inside ``root``."""
    tag, named_in = text.strip(), f"{os.fspath(root)}{os.sep}{source}"
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or os.path.isabs(tag):
        raise PathEscapeError(
            f"refusing to read {named_in}: it names {tag!r}, which is not a folder name inside the "
            f"checkpoint {root} (DeepSpeed tags look like global_step500). Fix the file or remove it"
        )
    if tag.startswith("."):
        raise PathEscapeError(
            f"refusing to read {named_in}: it names {tag!r}, a hidden or temporary folder (a save under way "
            "or left by a killed one), never a finished DeepSpeed tag; a checkpoint's manifest does not vouch for it. "
            "Fix the file or use an earlier checkpoint"
        )
    ConfinedFolder(Path(root)).path(tag, named_in=named_in)
    return tag


@dataclass(frozen=True)
class ConfinedFolder:
    """A checkpoint or model folder whose files are reached only through it: :meth:`path` (and :meth:`folder`,
    :meth:`is_file`, :meth:`is_dir`, :meth:`read_text` built on it) keeps every name, listed from the folder, one of
    hf_dist's own or read from a file, inside ``bound`` (``root`` unless this is a subfolder of another folder
    object, which stays confined to the outer one: a tag folder may link to a sibling inside the checkpoint)."""

    root: Path
    bound: Path | None = None

    def path(self, name: object, *, named_in: str | os.PathLike | None = None) -> Path:
        """``root / name`` when ``name`` is a relative path below ``root`` that resolves inside ``bound`` (links
        followed by the OS); else :class:`PathEscapeError` naming the file that named it, the name and where it
        leads."""
        where = f"{named_in} names" if named_in is not None else "the name"
        limit = self.bound or self.root
        if not isinstance(name, str) or not name.strip():
            raise PathEscapeError(
                f"refusing to read {named_in or self.root}: {where} {name!r} ({type(name).__name__}), not a file "
                f"name inside {limit}; fix the file"
            )
        pure = PurePath(name)
        if pure.is_absolute() or ".." in pure.parts or "\\" in name:
            raise PathEscapeError(
                f"refusing to read {named_in or Path(self.root, name)}: {where} {name!r}, which leaves the folder "
                f"{limit}; a checkpoint may only name files inside its own folder. Fix the file"
            )
        path = Path(self.root, name)
        if not is_inside(path, limit):
            raise PathEscapeError(
                f"refusing to read {path}{f' (named in {named_in})' if named_in is not None else ''}: it resolves to "
                f"{_real(path)}, outside the folder {limit}; copy the file into the folder or remove the link"
            )
        return path

    def folder(self, name: object, *, named_in: str | os.PathLike | None = None) -> ConfinedFolder:
        """The subfolder ``name`` as a folder object, confined to the same outer folder."""
        return ConfinedFolder(self.path(name, named_in=named_in), self.bound or self.root)

    def is_file(self, name: str) -> bool:
        return self.path(name).is_file()

    def is_dir(self, name: str) -> bool:
        return self.path(name).is_dir()

    def read_text(self, name: str) -> str:
        return self.path(name).read_text()
