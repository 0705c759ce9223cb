"""Atomic files and folders: a reader sees the old content or the new one, never half of either.

Everything hf_dist writes for a user (configs, markers, converted checkpoints, resharded folders,
results) goes through here: the content is written to a temporary sibling, flushed, and renamed over
the target (``os.replace`` is atomic on POSIX within one file system); on any error the temporary is
removed and the target is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# ``.NAME.tmp-PID`` (a folder being built) and ``.NAME.old-PID`` (the folder it replaces): siblings of NAME
_TEMP_RE = r"^\.{name}\.(?:tmp|old)-(\d+)$"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, create_parent: bool = True) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write (``atomic_write_bytes``, or a writer that takes a file name:
    ``torch.save``, safetensors); fsynced and renamed over ``path`` when the block succeeds, removed when it fails.
    ``create_parent=False``: a missing folder is an error, not created."""
    path = Path(path)
    if create_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a written file gets the usual permissions
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        _rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2, sort_keys: bool = False) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike, *, overwrite: bool = False, temp_parent: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Build a folder in a temporary ``.NAME.tmp-PID`` and move it to ``path`` only when the block succeeds.

    With ``overwrite`` an existing ``path`` is replaced (moved aside, then removed once the new folder is
    in place); without it an existing ``path`` is a FileExistsError before anything is written. The
    temporary is a sibling of ``path`` unless ``temp_parent`` names another folder on the same file system;
    temporaries that killed runs left there are removed first (:func:`remove_stale_temps`). A full disk is a
    RuntimeError saying so, a folder that cannot be created a PermissionError naming ``path``.
    """
    final = Path(path)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} exists; pass overwrite=True (CLI: --overwrite) to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    where = Path(temp_parent) if temp_parent is not None else final.parent
    where.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(where, final.name)
    tmp = where / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as exc:
        raise PermissionError(
            exc.errno, f"cannot write {final}: creating {tmp} failed ({exc.strerror}); choose a writable location"
        ) from None
    try:
        yield tmp
        replace_dir(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise RuntimeError(f"disk full while writing {final}; nothing was written, free space and retry") from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Move folder ``src`` to ``dst``, replacing an existing ``dst`` (kept aside until ``src`` is in place)."""
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        _rename(dst, old)
    try:
        _rename(src, dst)
    except BaseException:
        if old is not None:
            _rename(old, dst)
        raise
    if old is not None and old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    elif old is not None:
        old.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """The one rename of hf_dist: atomic on POSIX within a file system, replacing a file (or an empty folder)."""
    os.replace(src, dst)


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(parent: Path, name: str) -> list[Path]:
    """Remove ``.NAME.tmp-PID`` / ``.NAME.old-PID`` siblings whose process is gone (a killed run); return them.

    A temporary of a process still alive is left in place and named in a warning.
    """
    pattern = re.compile(_TEMP_RE.format(name=re.escape(name)))
    removed = []
    try:
        candidates = sorted(Path(parent).iterdir())
    except OSError:
        return []
    for path in candidates:
        match = pattern.match(path.name)
        if not match:
            continue
        if pid_alive(int(match.group(1))):
            if int(match.group(1)) != os.getpid():
                logger.warning("hf_dist: %s belongs to running process %s; left in place", path, match.group(1))
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        logger.warning("hf_dist: removed %s, left behind by a killed run (process %s)", path, match.group(1))
        removed.append(path)
    return removed
