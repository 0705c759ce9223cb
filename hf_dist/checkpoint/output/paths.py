"""Where a writer may write: the one path-safety check every output of hf_dist goes through.

A writer replaces its destination only when the user asked for it (``--overwrite``) and only when the
destination is a previous *output* of hf_dist, recognised by the ``hf_dist_output.json`` every output carries
(:func:`mark_output`): never a training checkpoint, a run folder, another tool's folder, the source itself, a folder
that contains the source or one inside it. A single output file (``hf-dist config --out``) is never written into a
training checkpoint or over one of its files. Every refusal names the path received, why, and what to do.
Writers then build their output with :func:`hf_dist.atomic_io.atomic_dir`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from hf_dist.checkpoint.formats.names import OUTPUT_MARKER, is_checkpoint_dir, is_training_state


class UnsafeOutputError(ValueError):
    """A destination that would overwrite or nest with what the user did not ask to replace."""


def training_state_in(folder: Path) -> str | None:
    """The first name in ``folder`` (top level) that marks a training checkpoint or run folder, else None."""
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return None
    for name in names:
        if is_training_state(name):
            return name
    return None


def _resolved(path: Path) -> Path:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError):  # a symlink loop: compare the path as written
        return Path(os.path.abspath(path.expanduser()))


def check_output_path(
    dst: str | os.PathLike,
    *,
    sources: Iterable[str | os.PathLike] = (),
    overwrite: bool = False,
    what: str = "DST",
    overwrite_flag: str = "--overwrite",
    is_dir: bool = True,
) -> Path:
    """Refuse a destination that is unsafe to (re)place; return it as a Path.

    ``sources``: what is being read (a destination equal to, containing or inside any of them is refused,
    overwrite or not). ``overwrite``: an existing destination may be replaced only if it holds no training
    state. ``is_dir``: the output is a folder (False: a single file).
    """
    raw = Path(dst).expanduser()
    if str(dst) == "" or raw.name in ("", ".", ".."):
        raise UnsafeOutputError(f"{what} {str(dst)!r} is not a usable output name; pass a new folder path")
    if raw.is_symlink():
        target = os.readlink(raw)
        state = "a dangling or looping symbolic link" if not raw.exists() else "a symbolic link"
        raise UnsafeOutputError(
            f"{what} {raw} is {state} (to {target}); hf_dist does not write through links: pass the real path "
            "or remove the link"
        )
    out = _resolved(raw)
    for source in sources:
        src = _resolved(Path(source))
        if out == src:
            raise UnsafeOutputError(
                f"{what} {raw} is the source {source} itself; writing there would replace it "
                f"({overwrite_flag} never does that). Choose a new folder, e.g. {raw.parent / (raw.name + '-hf')}"
            )
        if src in out.parents:
            raise UnsafeOutputError(
                f"{what} {raw} is inside the source {source}; writing there would change the checkpoint. "
                f"Choose a folder outside it, e.g. {src.parent / (src.name + '-hf')}"
            )
        if out in src.parents:
            raise UnsafeOutputError(
                f"{what} {raw} contains the source {source} (it is its run folder or a parent); replacing it "
                f"would delete the checkpoint. Choose a new folder next to it, e.g. {src.parent / 'hf-model'}"
            )
    if not is_dir:
        _check_not_into_training_state(raw, what=what)
    if raw.exists():
        _check_existing(raw, what=what, overwrite=overwrite, overwrite_flag=overwrite_flag, is_dir=is_dir)
    _check_parent(raw, what=what)
    return raw


def mark_output(folder: str | os.PathLike, tool: str, *, source: str | os.PathLike | None = None) -> None:
    """Say that ``folder`` is an output of hf_dist (``tool``), which ``--overwrite`` may replace later."""
    import json
    import time

    record = {"tool": tool, "source": str(source) if source is not None else None, "time": time.time()}
    (Path(folder) / OUTPUT_MARKER).write_text(json.dumps(record, indent=1) + "\n")


def _check_not_into_training_state(raw: Path, *, what: str) -> None:
    parent = Path(os.path.abspath(raw)).parent
    if is_training_state(raw.name) or (parent.is_dir() and (is_checkpoint_dir(parent) or training_state_in(parent))):
        raise UnsafeOutputError(
            f"{what} {raw} is in (or is a file of) a training checkpoint or run folder ({parent}); hf_dist never "
            "writes there. Choose a path outside it"
        )


def _check_existing(raw: Path, *, what: str, overwrite: bool, overwrite_flag: str, is_dir: bool) -> None:
    if is_dir and not raw.is_dir():
        raise UnsafeOutputError(f"{what} {raw} exists and is not a folder; remove it or choose another path")
    if not is_dir and raw.is_dir():
        raise UnsafeOutputError(f"{what} {raw} is a folder; pass a file path, e.g. {raw / 'config.yaml'}")
    if not overwrite:
        raise FileExistsError(
            f"{what} {raw} already exists; pass {overwrite_flag} to replace a previous output, or choose another path"
        )
    found = training_state_in(raw) if is_dir else None
    if found is not None:
        raise UnsafeOutputError(
            f"{what} {raw} holds training state ({found}): it is a training checkpoint or run folder, and "
            f"{overwrite_flag} replaces only a previous conversion output. Choose a new folder"
        )
    if is_dir and not (raw / OUTPUT_MARKER).is_file():
        raise UnsafeOutputError(
            f"{what} {raw} was not written by hf_dist (it has no {OUTPUT_MARKER}); {overwrite_flag} replaces only a "
            "previous output of hf-dist convert / reshard, so nobody else's files are deleted. Choose a new folder, "
            "or remove this one yourself"
        )


def _check_parent(raw: Path, *, what: str) -> None:
    parent = Path(os.path.abspath(raw)).parent
    existing = parent
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link on the way
            raise UnsafeOutputError(f"{what} {raw}: {existing} is a dangling symbolic link; fix or remove it")
        existing = existing.parent
    if not existing.is_dir():
        raise UnsafeOutputError(f"{what} {raw}: {existing} is a file, not a folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, f"{what} {raw}: cannot write in {existing} (read-only or no permission); choose a "
            "writable location"
        )  # fmt: skip


def make_parent(raw: Path, *, what: str = "DST") -> None:
    """``mkdir -p`` of ``raw``'s parent with a clear error instead of a traceback."""
    try:
        raw.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PermissionError(
            errno.EACCES, f"{what} {raw}: cannot create {raw.parent} ({exc.strerror}); choose a writable location"
        ) from None


def format_bytes(count: int) -> str:
    """``718 B``, ``3.4 MB``, ``12.50 GB``: sizes in messages that stay meaningful for tiny outputs."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"
