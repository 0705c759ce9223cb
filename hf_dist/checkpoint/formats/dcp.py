"""Read a torch.distributed.checkpoint (DCP) folder: safe metadata, tensors loaded in bounded batches.

``.metadata`` is unpickled by :func:`hf_dist.checkpoint.safety.dcp_metadata.load_metadata` (only DCP's own
metadata types allowed, every file it names inside the folder); the reader maps DCP's classes to inert stand-ins (``stand_ins=True``): no DCP code runs,
and ``torch.distributed`` (about 1.8 s of imports) is never imported on the direct path.

Tensors are read directly from the ``.distcp`` files, a batch at a time: each chunk is a small
``torch.save`` archive at a known offset; its header is read with ``torch.load(weights_only=True,
map_location="meta")`` (shape, stride, dtype and where its bytes start, no data). A contiguous chunk
landing in a contiguous region of the full tensor (FSDP's row shards) is read straight into it with
one ``readinto``; any other chunk is viewed through a memory map and copied. That is one copy from
the page cache instead of ``dcp.load``'s read + unpickle + copy per chunk and its planning per call.
Chunks stored with a transform (e.g. compression) go through ``dcp.load``. When a tensor is written
unchanged, :meth:`DCPReader.byte_ranges` hands the converter the file ranges of its row shards and
nothing is read into memory at all.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.checkpoint_folder import CheckpointFolder
from hf_dist.checkpoint.formats.names import DCP_METADATA, DCP_SHARD_FILE_RE
from hf_dist.checkpoint.formats.reader import Reader, TensorSpec
from hf_dist.checkpoint.safety.dcp_metadata import load_metadata
from hf_dist.checkpoint.safety.errors import CorruptCheckpointError


class DCPReader(Reader):
    def __init__(self, checkpoint: CheckpointFolder, *, trust_pickles: bool = False) -> None:
        super().__init__()
        self._data = checkpoint.data
        self.folder = self._data.root
        self.trust_pickles = trust_pickles
        metadata = load_metadata(self.folder, trust_pickles=trust_pickles, stand_ins=True)
        self._check_files(metadata)
        for name, item in metadata.state_dict_metadata.items():
            if type(item).__name__.startswith("TensorStorageMetadata"):  # the class or its stand-in
                self._specs[name] = TensorSpec(tuple(item.size), item.properties.dtype)
                covered = sum(_numel(chunk.sizes) for chunk in item.chunks)
                if covered < _numel(item.size):
                    raise ValueError(
                        f"{self.folder}: tensor {name} has chunks covering {covered} of {_numel(item.size)} elements"
                    )
        if self._specs and all(name.startswith("optimizer.") for name in self._specs):
            raise ValueError(
                f"{self.folder} holds optimizer state (Adam moments keyed 'optimizer.state...'), not model weights; "
                f"convert or verify the checkpoint folder it belongs to ({self.folder.parent})"
            )
        self.found = {"world_size": self._world_size(metadata)}
        self._chunks: dict[str, list] = {}  # name -> [(chunk offsets, _StorageInfo)]
        for index, storage in (metadata.storage_data or {}).items():
            if index.fqn in self._specs:  # non-tensor values (a step, param_groups) carry no offset: not weights
                self._chunks.setdefault(index.fqn, []).append((tuple(index.offset), storage))
        self._maps: dict[str, Any] = {}  # relative path -> memory-mapped UntypedStorage
        self._files: dict[str, Any] = {}  # relative path -> open file
        self._headers: dict[tuple[str, int], tuple[Any, int]] = {}  # (file, offset) -> (meta tensor, data start)

    def _check_files(self, metadata) -> None:
        files = {info.relative_path for info in (metadata.storage_data or {}).values()}
        missing = sorted(f for f in files if not self._path(f).is_file())
        if missing:
            raise FileNotFoundError(
                f"{self.folder} is incomplete: .metadata lists {len(files)} data files but {missing} are missing; "
                "copy the whole checkpoint folder"
            )
        for name in files:
            needed = max(i.offset + i.length for i in metadata.storage_data.values() if i.relative_path == name)
            size = self._path(name).stat().st_size
            if size < needed:
                raise CorruptCheckpointError(
                    f"{self._path(name)} is truncated: {size} bytes, the metadata needs {needed}; re-copy it"
                )

    def _path(self, relative: object) -> Path:
        """A data file the metadata names, confined to the folder (the one join of a name read from .metadata)."""
        return self._data.path(str(relative), named_in=self._data.path(DCP_METADATA))

    @staticmethod
    def _world_size(metadata) -> int | None:
        files = {info.relative_path for info in (metadata.storage_data or {}).values()}
        ranks = {m["rank"] for name in files if (m := DCP_SHARD_FILE_RE.match(name))}
        return len(ranks) or None

    def read(self, names: list[str]) -> dict[str, Any]:
        import torch

        direct = [n for n in names if not any(getattr(s, "transform_descriptors", None) for _, s in self._chunks[n])]
        state = self._read_with_dcp([n for n in names if n not in direct])
        for name in direct:
            spec = self._specs[name]
            full = torch.empty(spec.shape, dtype=spec.dtype)
            for offsets, storage in self._chunks[name]:
                meta, start = self._header(name, storage)
                fits = len(offsets) == meta.dim() == len(spec.shape) and all(
                    o + n <= d for o, n, d in zip(offsets, meta.shape, spec.shape, strict=True)
                )
                if meta.dtype != spec.dtype or not fits:
                    raise CorruptCheckpointError(
                        f"{self._path(storage.relative_path)}: chunk of {name} at {list(offsets)} is "
                        f"{meta.dtype} {list(meta.shape)}, which does not fit {spec.dtype} {list(spec.shape)} from "
                        ".metadata: the data files and .metadata come from different saves; re-copy the whole folder"
                    )
                target = full
                for dim, (begin, length) in enumerate(zip(offsets, meta.shape, strict=True)):
                    target = target.narrow(dim, begin, length)
                if meta.is_contiguous() and target.is_contiguous():  # e.g. FSDP's row shards: one read, no map
                    self._read_into(target, storage, start + meta.storage_offset() * meta.element_size())
                else:
                    target.copy_(self._mapped(storage, meta, start))
            state[name] = full
        return state

    def byte_ranges(self, name: str) -> list[tuple[str, int, int]] | None:
        """Row shards (chunks split along dim 0 only, contiguous, same dtype) are plain byte ranges in row order."""
        spec = self._specs[name]
        chunks = sorted(self._chunks[name], key=lambda chunk: chunk[0])
        if not spec.shape or any(getattr(s, "transform_descriptors", None) for _, s in chunks):
            return None
        ranges, next_row = [], 0
        for offsets, storage in chunks:
            meta, start = self._header(name, storage)
            whole_rows = len(offsets) == meta.dim() == len(spec.shape) and tuple(meta.shape[1:]) == spec.shape[1:]
            whole_rows = whole_rows and not any(offsets[1:])
            if meta.dtype != spec.dtype or not meta.is_contiguous() or not whole_rows or offsets[0] != next_row:
                return None
            next_row += meta.shape[0]
            position = start + meta.storage_offset() * meta.element_size()
            ranges.append((str(self._path(storage.relative_path)), position, meta.numel() * meta.element_size()))
        return ranges if next_row == spec.shape[0] else None

    def _file(self, storage) -> Any:
        if storage.relative_path not in self._files:
            self._files[storage.relative_path] = open(self._path(storage.relative_path), "rb")  # noqa: SIM115
        return self._files[storage.relative_path]

    def _header(self, name: str, storage) -> tuple[Any, int]:
        """The chunk as a meta tensor (shape, strides, dtype) and the file offset where its storage starts.

        Parsed once per chunk (``byte_ranges`` and ``read`` both need it); a few hundred bytes each.
        """
        import torch

        key = (storage.relative_path, storage.offset)
        if key in self._headers:
            return self._headers[key]
        try:
            view = _FileSlice(self._file(storage), storage.offset, storage.length)
            meta = torch.load(view, map_location="meta", weights_only=True)
            if not isinstance(meta, torch.Tensor):
                raise ValueError(f"the chunk holds a {type(meta).__name__}, not a tensor")
            start = storage.offset + meta.untyped_storage()._checkpoint_offset
            if start + meta.untyped_storage().nbytes() > storage.offset + storage.length:
                raise ValueError("the chunk's data runs past its slice of the file")
        except Exception as exc:
            raise CorruptCheckpointError(
                f"cannot read {name} from {self._path(storage.relative_path)} at byte {storage.offset} "
                f"({type(exc).__name__}: {str(exc)[:200]}); the file is corrupt or was written by an incompatible tool"
            ) from None
        self._headers[key] = meta, start
        return meta, start

    def _read_into(self, target: Any, storage, position: int) -> None:
        """Read the chunk's bytes straight into ``target`` (contiguous) from the file."""
        import torch

        buffer = memoryview(target.view(-1).view(torch.uint8).numpy())
        handle = self._file(storage)
        handle.seek(position)
        if handle.readinto(buffer) != len(buffer):
            raise CorruptCheckpointError(f"{handle.name} ends inside a tensor at byte {position}; re-copy it")

    def _mapped(self, storage, meta: Any, start: int) -> Any:
        """The chunk as a tensor viewing the memory-mapped file (no copy), with its saved strides."""
        import torch

        path = self._path(storage.relative_path)
        if storage.relative_path not in self._maps:
            self._maps[storage.relative_path] = torch.UntypedStorage.from_file(str(path), False, path.stat().st_size)
        data = self._maps[storage.relative_path][start : start + meta.untyped_storage().nbytes()]
        return torch.empty(0, dtype=meta.dtype).set_(data, meta.storage_offset(), meta.shape, meta.stride())

    def _chunk(self, name: str, storage) -> Any:
        """One saved chunk as a tensor (a view of the memory-mapped file)."""
        meta, start = self._header(name, storage)
        return self._mapped(storage, meta, start)

    def release(self) -> None:
        self._maps.clear()
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def _read_with_dcp(self, names: list[str]) -> dict[str, Any]:
        if not names:
            return {}
        import torch
        import torch.distributed.checkpoint as dcp

        from hf_dist.checkpoint.safety.loading import PathEscapeError, UnsafePickleError, guarded_loads

        state = {name: torch.empty(self._specs[name].shape, dtype=self._specs[name].dtype) for name in names}
        try:
            with guarded_loads(self.folder, trust_pickles=self.trust_pickles):
                dcp.load(state, storage_reader=dcp.FileSystemReader(str(self.folder)), no_dist=True)
        except (UnsafePickleError, PathEscapeError):
            raise
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"cannot read tensors from {self.folder}: {str(exc)[:300]}") from None
        return state


class _FileSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file, as a seekable file of their own (for torch.load)."""

    def __init__(self, handle, offset: int, length: int) -> None:
        super().__init__()
        self._handle, self._start, self._length, self._pos = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer) -> int:
        size = min(len(buffer), self._length - self._pos)
        if size <= 0:
            return 0
        self._handle.seek(self._start + self._pos)
        got = self._handle.readinto(memoryview(buffer)[:size])
        self._pos += got
        return got


def _numel(size) -> int:
    n = 1
    for dim in size:
        n *= dim
    return n
