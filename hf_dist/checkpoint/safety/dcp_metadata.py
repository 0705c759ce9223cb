"""DCP's ``.metadata`` unpickled safely, and the non-tensor payloads of its ``.distcp`` files listed for the gate.

``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``, which runs whatever the file
names. :func:`load_metadata` unpickles it with only DCP's own metadata dataclasses (``DCP_MODULES`` x ``DCP_NAMES``),
``torch.Size``, dtypes/layouts and ``pathlib`` paths (``OTHER_GLOBALS``) allowed; :func:`safe_filesystem_reader`
uses it, so ``dcp.load`` never unpickles foreign code from ``.metadata``; the non-tensor payloads, which it loads
with ``weights_only=False``, are listed by :func:`byte_payloads` for the loading gate
(:mod:`hf_dist.checkpoint.safety.pickles`, which allows the same names). With ``stand_ins=True`` DCP's classes
become inert records: no DCP code runs and ``torch.distributed`` is never imported.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.safety.errors import CorruptCheckpointError, OpaqueObject, UnsafePickleError

DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
DCP_NAMES = {
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex", "_StorageInfo",
}  # fmt: skip
OTHER_GLOBALS = {
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
}


class _TensorPropertiesStub(OpaqueObject):
    """TensorProperties pickles as a tuple (dtype, layout, requires_grad, memory-format code, pin_memory)."""

    def __setstate__(self, state: tuple) -> None:
        self.dtype = state[0]


def _stand_in(name: str) -> Any:
    if name == "TensorProperties":
        return _TensorPropertiesStub
    if name == "_MEM_FORMAT_ENCODING":  # an Enum, pickled as _MEM_FORMAT_ENCODING(value)
        return int
    return type(f"{name}Stub", (OpaqueObject,), {})  # dataclasses: NEWOBJ + BUILD fill __dict__


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path, stand_ins: bool) -> None:
        super().__init__(file)
        self.path = path
        self.stand_ins = stand_ins
        self._made: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in DCP_MODULES and name in DCP_NAMES and self.stand_ins:
            return self._made.setdefault(name, _stand_in(name))
        if (module in DCP_MODULES and name in DCP_NAMES) or (module, name) in OTHER_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafePickleError(
            f"refusing to unpickle {self.path}: it contains the type {module}.{name}, which is not part of DCP "
            "metadata; pass --trust-pickles (trust_pickles=True) only if you trust this file"
        )


def load_metadata(folder: Path, *, trust_pickles: bool = False, stand_ins: bool = False):
    """The DCP ``Metadata`` of ``folder``; with ``stand_ins`` DCP's classes are inert records with the same fields."""
    path = Path(folder) / ".metadata"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {folder} is not a complete DCP checkpoint")
    with open(path, "rb") as handle:
        try:
            return pickle.load(handle) if trust_pickles else _MetadataUnpickler(handle, path, stand_ins).load()
        except UnsafePickleError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"cannot read DCP metadata {path} ({type(exc).__name__}: {exc})") from None


def byte_payloads(folder: Path) -> list[tuple[str, Path, int, int, bool]]:
    """The non-tensor values of a DCP folder (an optimizer's ``param_groups``, ...): ``(name, .distcp file, offset,
    length, transformed)`` each. DCP writes every one as a ``torch.save`` archive inside a ``.distcp`` file and
    loads it with ``torch.load(weights_only=False)``; the loading gate checks them. Raises like
    :func:`load_metadata` for an unsafe or unreadable ``.metadata``."""
    metadata = load_metadata(folder, stand_ins=True)
    kinds = getattr(metadata, "state_dict_metadata", None) or {}  # (not DCP metadata at all: nothing to list)
    payloads = []
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if type(kinds.get(index.fqn)).__name__ == "BytesStorageMetadataStub":  # named by _stand_in
            transformed = bool(getattr(info, "transform_descriptors", None))
            payloads.append((index.fqn, Path(folder) / info.relative_path, info.offset, info.length, transformed))
    return payloads


def safe_filesystem_reader(folder: str | Path, *, trust_pickles: bool = False):
    """A ``FileSystemReader`` for ``dcp.load`` whose ``.metadata`` is read by :func:`load_metadata`. The
    ``.distcp`` payloads it unpickles must have passed :func:`hf_dist.checkpoint.safety.pickles.check_pickles`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = load_metadata(Path(self.path), trust_pickles=trust_pickles)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(folder))
