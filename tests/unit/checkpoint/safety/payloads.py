"""What an attacker plants in a checkpoint: a pickle payload in each torch serialization format, and path escapes.

The payload makes a folder when unpickled by a loader that trusts the file (``torch.load(weights_only=False)``,
``pickle.load``); a test asserts the folder never appears. Formats, as ``torch.load`` dispatches them:

- ``zip``: ``torch.save``'s archive;
- ``two directories``: one file, two archives, two central directories of equal size: Python's ``zipfile`` reads
  the one just before the end record (clean), torch's reader the one the end record declares (the payload);
- ``legacy``: torch's pre-1.6 stream of pickles (``_use_new_zipfile_serialization=False``);
- ``tar``: torch's pre-0.4 tar format, which ``torch.load(weights_only=False)`` unpickles with no allowlist.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import tarfile
from pathlib import Path
from typing import Any

import torch


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _state(path: Path) -> dict:
    state = torch.load(path, weights_only=False)  # our own, freshly written file
    return state if isinstance(state, dict) else {"value": state}


def _zip_parts(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(local entries, central directory, end record) of a single-archive zip."""
    end = data.rindex(b"PK\x05\x06")
    size, offset = struct.unpack("<II", data[end + 12 : end + 20])
    return data[:offset], data[offset : offset + size], data[end:]


def _shift_local_offsets(directory: bytes, delta: int) -> bytes:
    out, i = bytearray(directory), 0
    while i < len(out):
        name, extra, comment = struct.unpack("<HHH", out[i + 28 : i + 34])
        (offset,) = struct.unpack("<I", out[i + 42 : i + 46])
        out[i + 42 : i + 46] = struct.pack("<I", offset + delta)
        i += 46 + name + extra + comment
    return bytes(out)


def two_directories(clean: Any, evil: Any) -> bytes:
    """``evil``'s archive first, then ``clean``'s, each with its central directory; the end record declares the
    evil directory's offset and the clean one's size (equal), so ``zipfile`` and torch read different archives."""
    a, b = io.BytesIO(), io.BytesIO()
    torch.save(clean, a)
    torch.save(evil, b)
    clean_locals, clean_dir, end = _zip_parts(a.getvalue())
    evil_locals, evil_dir, _ = _zip_parts(b.getvalue())
    assert len(clean_dir) == len(evil_dir) and len(evil_locals) >= len(clean_locals)
    clean_dir = _shift_local_offsets(clean_dir, len(evil_locals) - len(clean_locals))
    record = bytearray(end)
    record[12:20] = struct.pack("<II", len(clean_dir), len(evil_locals))
    return evil_locals + evil_dir + clean_locals + clean_dir + bytes(record)


def _tar(marker: Path) -> bytes:
    """torch's legacy tar format (``torch/serialization.py``, ``_legacy_load``): ``storages`` is unpickled first."""
    members = {"N.N.N.N.N.": b"", "storages": pickle.dumps(Payload(marker), protocol=2),
               "tensors": pickle.dumps(0, protocol=2), "pickle": pickle.dumps({}, protocol=2)}  # fmt: skip
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


FORMATS = ("zip", "two directories", "legacy", "tar")


def plant(path: Path, marker: Path, fmt: str = "zip") -> None:
    """Rewrite the torch file ``path`` so loading it with ``weights_only=False`` creates ``marker``."""
    state = _state(path)
    evil = {**state, "hf_dist_test_payload": Payload(marker)}
    if fmt == "zip":
        torch.save(evil, path)
    elif fmt == "two directories":
        path.write_bytes(two_directories(state, evil))
    elif fmt == "legacy":
        torch.save(evil, path, _use_new_zipfile_serialization=False)
    elif fmt == "tar":
        path.write_bytes(_tar(marker))
    else:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


def plant_metadata(path: Path, marker: Path) -> None:
    """A DCP ``.metadata`` (a plain pickle) carrying the payload as an extra attribute."""
    with open(path, "rb") as handle:
        metadata = pickle.load(handle)
    metadata.planted = Payload(marker)
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)


def plant_dcp_value(folder: Path, marker: Path, tensors: dict | None = None) -> None:
    """A DCP save with a non-tensor value, stored as DCP stores an optimizer's param_groups: a torch.save archive
    inside the .distcp file, which ``dcp.load`` unpickles with ``weights_only=False``."""
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(folder, ignore_errors=True)
    state = dict(tensors or {"state": torch.ones(2)})
    state["param_groups"] = Payload(marker)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


# ---------------------------------------------------------------- path escapes

ESCAPES = ("latest names ..", "latest is absolute", "tag is a link", "shard is a link")


def escape(ckpt: Path, how: str, outside: Path) -> Path:
    """Make DeepSpeed checkpoint ``ckpt`` read from ``outside`` (a copy of its tag folder with a payload planted
    there); returns the path refused."""
    tag = (ckpt / "latest").read_text().strip()
    shutil.copytree(ckpt / tag, outside / tag)
    for file in sorted((outside / tag).glob("*.pt")):
        plant(file, outside / "PAYLOAD_RAN")
    if how == "latest names ..":
        rel = os.path.relpath(outside / tag, ckpt)
        (ckpt / "latest").write_text(rel)
        return ckpt / "latest"
    if how == "latest is absolute":
        (ckpt / "latest").write_text(str(outside / tag))
        return ckpt / "latest"
    if how == "tag is a link":
        shutil.rmtree(ckpt / tag)
        (ckpt / tag).symlink_to(outside / tag, target_is_directory=True)
        return ckpt / tag
    if how == "shard is a link":
        shard = sorted((ckpt / tag).glob("*model_states.pt"))[0]
        shard.unlink()
        shard.symlink_to(outside / tag / shard.name)
        return shard
    raise ValueError(f"unknown escape {how!r}; one of {ESCAPES}")
