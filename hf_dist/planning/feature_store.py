"""The probed library features, kept on disk per set of installed libraries: a plan reads them without importing
transformers, accelerate or torch (about 3 s on 2 cores; the plan itself takes less than one).

The file is ``features-<key>.json`` in ``$HF_DIST_CACHE_DIR`` (default ``$XDG_CACHE_HOME/hf_dist``, else
``~/.cache/hf_dist``). The key hashes the Python version and, for each library probed (and hf_dist's probe
itself), its installed version and the modification time of its package file, found without importing it. An
upgrade, a downgrade or an editable checkout that moves changes the key, so the features are probed again. A file
that cannot be read, holds other fields or values of the wrong type is ignored and probed over; one that cannot be
written (a read-only home, or no home at all) only costs the probe next time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_write_json

PROBED = ("torch", "transformers", "accelerate", "deepspeed", "peft")
CACHE_ENV = "HF_DIST_CACHE_DIR"


def cache_dir() -> Path:
    """Where hf_dist keeps what it probed: ``$HF_DIST_CACHE_DIR``, else ``$XDG_CACHE_HOME/hf_dist``, else
    ``~/.cache/hf_dist``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_dist"


def _installed(name: str) -> list[Any]:
    """``name``'s version and its package file's modification time, None for what is absent; nothing is imported."""
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = None
    spec = importlib.util.find_spec(name)
    origin = spec.origin if spec is not None else None
    return [version, os.stat(origin).st_mtime_ns if origin and os.path.exists(origin) else None]


def store_path() -> Path:
    """The file the features of the libraries installed now are kept in."""
    probe = Path(__file__).with_name("features.py")
    key = [sys.version, os.stat(probe).st_mtime_ns, *(_installed(name) for name in PROBED)]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]
    return cache_dir() / f"features-{digest}.json"


def load_features(cls: type) -> Any | None:
    """The stored ``cls`` (a dataclass of plain values) for the installed libraries, or None to probe them."""
    try:
        data = json.loads(store_path().read_text(encoding="utf-8"))
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != set(fields):
            return None
        if any(type(value) is not type(fields[name].default) for name, value in data.items()):
            return None
        return cls(**data)
    except (OSError, ValueError, TypeError, RuntimeError):  # RuntimeError: no home folder to find the store in
        return None


def store_features(features: Any) -> None:
    """Keep ``features`` for the installed libraries; a cache that cannot be written is skipped."""
    with contextlib.suppress(OSError, RuntimeError):
        atomic_write_json(store_path(), dataclasses.asdict(features), sort_keys=True)
