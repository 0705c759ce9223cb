"""DCP's ``.metadata``: its one parse, a restricted unpickler, and the files it names confined to its folder.

``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``, which runs whatever the file
names; torch's ``weights_only`` unpickler cannot stand in (it parses pickle protocol 2, DCP writes protocol 4:
"Unsupported operand 149", the FRAME opcode). So :func:`metadata_from_file` *is* the load, not a check before one:
an unpickler that admits only DCP's own metadata dataclasses (``DCP_MODULES`` x ``DCP_NAMES``), ``torch.Size``,
dtypes/layouts and ``pathlib`` paths (``OTHER_GLOBALS``) and refuses anything else while it parses. hf_dist's DCP
reader calls it directly (``stand_ins=True``: DCP's classes become inert records and ``torch.distributed`` is never
imported); every ``dcp.load`` hf_dist drives gets it in place of ``pickle.load`` through
:func:`hf_dist.checkpoint.safety.loading.guarded_loads` (:func:`read_reader_metadata`). DCP's non-tensor payloads
are ``torch.load`` calls, which that guard redirects to the ``weights_only`` load.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.safety.errors import CorruptCheckpointError, OpaqueObject, UnsafePickleError
from hf_dist.checkpoint.safety.paths import ConfinedFolder, confined

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
            f"refusing to load {self.path}: it names the global {module}.{name}, which is not part of DCP "
            "metadata; nothing in it ran; pass --trust-pickles (trust_pickles=True) only if you trust this file"
        )


def load_metadata(folder: Path, *, trust_pickles: bool = False, stand_ins: bool = False):
    """The DCP ``Metadata`` of ``folder``; with ``stand_ins`` DCP's classes are inert records with the same fields.
    Every file its storage entries name must resolve inside ``folder``."""
    metadata = metadata_from_file(
        ConfinedFolder(Path(folder)).path(".metadata"), trust_pickles=trust_pickles, stand_ins=stand_ins
    )
    check_storage_confined(metadata, Path(folder))
    return metadata


def metadata_from_file(path: Path, *, trust_pickles: bool = False, stand_ins: bool = False):
    """Unpickle one DCP metadata file with the restricted unpickler (the only parse it gets)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {path.parent} is not a complete DCP checkpoint")
    data = path.read_bytes()
    check_lengths(data, path)
    handle = io.BytesIO(data)
    try:
        return pickle.load(handle) if trust_pickles else _MetadataUnpickler(handle, path, stand_ins).load()
    except UnsafePickleError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"cannot read DCP metadata {path} ({type(exc).__name__}: {exc})") from None


def check_lengths(data: bytes, path: Path) -> None:
    """Every length the pickle ``data`` claims (a frame, bytes, a string, a long) fits in the file's own bytes: checked
    before the unpickler allocates it (CPython's allocates a claimed ``BINBYTES8`` length first, 2**40 included)."""
    import pickletools

    stream = io.BytesIO(data)
    try:
        for opcode, arg, position in pickletools.genops(stream):
            if opcode.name == "FRAME" and arg > len(data) - stream.tell():
                raise ValueError(f"a frame at byte {position} claims {arg} bytes, {len(data) - stream.tell()} remain")
    except ValueError as exc:  # genops: a counted argument longer than what remains, an unknown opcode, no STOP
        raise CorruptCheckpointError(
            f"refusing to read DCP metadata {path}: {exc} (every length in it is checked against its {len(data)} "
            "bytes); the file is corrupt or crafted: re-copy the checkpoint"
        ) from None


def check_storage_confined(metadata: Any, folder: Path) -> None:
    """Refuse metadata whose storage entries name a file outside ``folder`` (``../x.distcp``, an absolute path, a
    link leading out): DCP opens ``folder / relative_path`` as written."""
    data_files = ConfinedFolder(Path(folder))
    named_in = data_files.path(".metadata")
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is not None:
            data_files.path(str(relative), named_in=named_in)


def byte_payloads(folder: Path) -> list[tuple[str, Path, int, int]]:
    """The non-tensor values of a DCP folder (an optimizer's ``param_groups``, ...) stored plainly: ``(name, .distcp
    file, offset, length)`` each, a ``torch.save`` archive that ``dcp.load`` unpickles. Values stored with a
    transform (compression) are left out: only DCP can decode them, and it does so under the guard."""
    metadata = load_metadata(folder, stand_ins=True)
    kinds = getattr(metadata, "state_dict_metadata", None) or {}  # (not DCP metadata at all: nothing to list)
    payloads = []
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        plain = not getattr(info, "transform_descriptors", None)
        if type(kinds.get(index.fqn)).__name__ == "BytesStorageMetadataStub" and plain:  # named by _stand_in
            data_files = ConfinedFolder(Path(folder))
            path = data_files.path(str(info.relative_path), named_in=data_files.path(".metadata"))
            payloads.append((index.fqn, path, info.offset, info.length))
    return payloads


def read_reader_metadata(reader: Any, root: Path, *, trust_pickles: bool = False, rank: int | None = None):
    """What ``FileSystemReader.read_metadata`` returns, read by :func:`metadata_from_file` with real DCP classes
    and confined to the reader's folder (and the guard's ``root``); installed by
    :func:`hf_dist.checkpoint.safety.loading.guarded_loads` for every DCP load hf_dist drives."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    folder = Path(reader.path)
    own = ConfinedFolder(folder)
    path = Path(reader._get_metadata_path(rank)) if hasattr(reader, "_get_metadata_path") else own.path(".metadata")
    confined(path, root)
    metadata = metadata_from_file(confined(path, folder), trust_pickles=trust_pickles)
    check_storage_confined(metadata, folder)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata
