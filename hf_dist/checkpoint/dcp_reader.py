"""Read a torch.distributed.checkpoint (DCP) folder: safe metadata, tensors loaded in bounded batches.

``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``, which runs
whatever the file names. :func:`load_metadata` unpickles it with only DCP's own metadata
dataclasses, ``torch.Size``, dtypes/layouts and ``pathlib`` paths allowed; :class:`SafeFileSystemReader`
uses it, so ``dcp.load`` (which already loads tensor payloads with ``weights_only=True``) never
unpickles foreign code. Tensors are loaded with ``dcp.load(..., no_dist=True)`` a batch at a time:
DCP reassembles each full tensor from however many rank chunks it was saved in.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.detect import CheckpointInfo
from hf_dist.checkpoint.reader import Reader, TensorSpec
from hf_dist.checkpoint.safe_pickle import CorruptCheckpointError, UnsafePickleError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_NAMES = {
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex", "_StorageInfo",
}  # fmt: skip
_OTHER_GLOBALS = {
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module in _DCP_MODULES and name in _DCP_NAMES) or (module, name) in _OTHER_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafePickleError(
            f"refusing to unpickle {self.path}: it contains the type {module}.{name}, which is not part of DCP "
            "metadata; pass --trust-pickles (trust_pickles=True) only if you trust this file"
        )


def load_metadata(folder: Path, *, trust_pickles: bool = False):
    path = Path(folder) / ".metadata"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {folder} is not a complete DCP checkpoint")
    with open(path, "rb") as handle:
        try:
            return pickle.load(handle) if trust_pickles else _MetadataUnpickler(handle, path).load()
        except UnsafePickleError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"cannot read DCP metadata {path} ({type(exc).__name__}: {exc})") from None


def _safe_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """FileSystemReader whose ``.metadata`` is read by :func:`load_metadata`."""

        trust_pickles = False

        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = load_metadata(Path(self.path), trust_pickles=self.trust_pickles)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


class DCPReader(Reader):
    def __init__(self, info: CheckpointInfo, *, trust_pickles: bool = False) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        super().__init__()
        self.folder = info.path
        self.trust_pickles = trust_pickles
        metadata = load_metadata(self.folder, trust_pickles=trust_pickles)
        self._check_files(metadata)
        for name, item in metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                self._specs[name] = TensorSpec(tuple(item.size), item.properties.dtype)
                covered = sum(_numel(chunk.sizes) for chunk in item.chunks)
                if covered < _numel(item.size):
                    raise ValueError(
                        f"{self.folder}: tensor {name} has chunks covering {covered} of {_numel(item.size)} elements"
                    )
        info.world_size = self._world_size(metadata)

    def _check_files(self, metadata) -> None:
        files = {info.relative_path for info in (metadata.storage_data or {}).values()}
        missing = sorted(f for f in files if not (self.folder / f).is_file())
        if missing:
            raise FileNotFoundError(
                f"{self.folder} is incomplete: .metadata lists {len(files)} data files but {missing} are missing; "
                "copy the whole checkpoint folder"
            )
        for name in files:
            needed = max(i.offset + i.length for i in metadata.storage_data.values() if i.relative_path == name)
            size = (self.folder / name).stat().st_size
            if size < needed:
                raise CorruptCheckpointError(
                    f"{self.folder / name} is truncated: {size} bytes, the metadata needs {needed}; re-copy it"
                )

    @staticmethod
    def _world_size(metadata) -> int | None:
        files = {info.relative_path for info in (metadata.storage_data or {}).values()}
        ranks = {name.split("_")[2] for name in files if name.startswith("__") and name.endswith(".distcp")}
        return len(ranks) or None

    def read(self, names: list[str]) -> dict[str, Any]:
        import torch
        import torch.distributed.checkpoint as dcp

        state = {name: torch.empty(self._specs[name].shape, dtype=self._specs[name].dtype) for name in names}
        reader = _safe_reader_class()(str(self.folder))
        reader.trust_pickles = self.trust_pickles
        try:
            dcp.load(state, storage_reader=reader, no_dist=True)
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"cannot read tensors from {self.folder}: {str(exc)[:300]}") from None
        return state


def _numel(size) -> int:
    n = 1
    for dim in size:
        n *= dim
    return n
