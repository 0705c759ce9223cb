"""Write an HF folder shard by shard, tensor by tensor, into a temporary folder renamed at the end.

The shard plan comes from ``huggingface_hub``'s sharding helper (same file names and index as
``save_pretrained``). Each shard is written as a safetensors file whose header is computed up
front from shapes and dtypes, then each tensor's bytes are appended as soon as it is read, so no
more than one tensor (plus the reader's batch) is in memory at once. A tensor the reader can
describe as byte ranges of its files (:class:`FileRanges`: stored dtype = output dtype, no merge)
is copied file to file by the kernel (``os.copy_file_range``) and never enters this process.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_dir
from hf_dist.checkpoint.formats.reader import TensorSpec
from hf_dist.checkpoint.safety.paths import ConfinedFolder

SAFETENSORS_DTYPES = {
    "torch.float32": "F32",
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float64": "F64",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int16": "I16",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
}


@dataclass(frozen=True)
class FileRanges:
    """A tensor's bytes, in order, as ``(file, offset, length)`` ranges of source files."""

    ranges: list[tuple[str, int, int]]

    @property
    def nbytes(self) -> int:
        return sum(length for _, _, length in self.ranges)


_KERNEL_COPY = hasattr(os, "copy_file_range")
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.EBADF}


def copy_ranges(ranges: list[tuple[str, int, int]], dst_fd: int) -> None:
    """Append the bytes of ``ranges`` to ``dst_fd`` at its current position.

    ``os.copy_file_range`` copies inside the kernel (page cache to page cache, or server-side on
    network filesystems); where it is missing or refused (other filesystem, old kernel) the bytes
    go through a bounded buffer instead.
    """
    global _KERNEL_COPY
    for path, offset, length in ranges:
        with open(path, "rb", buffering=0) as src:
            end = offset + length
            while offset < end:
                count = min(end - offset, 1 << 30)
                copied = None
                if _KERNEL_COPY:
                    try:
                        copied = os.copy_file_range(src.fileno(), dst_fd, count, offset)
                    except OSError as exc:
                        if exc.errno not in _NO_KERNEL_COPY:
                            raise
                        _KERNEL_COPY = False
                if copied is None:
                    data = os.pread(src.fileno(), min(count, 64 * 1024**2), offset)
                    copied = len(data)
                    _write_all(dst_fd, data)
                if copied == 0:
                    raise RuntimeError(
                        f"{path} ends at byte {offset}, inside a tensor ({end - offset} bytes short); re-copy it"
                    )
                offset += copied


def _write_all(fd: int, data: Any) -> None:
    """``os.write`` until every byte is written (a single call may write fewer)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def plan_shards(specs: dict[str, TensorSpec], max_shard_size: int | str, *, weights_name: str = "model.safetensors"):
    """huggingface_hub's shard split over specs (no tensors needed); returns its StateDictSplit."""
    from huggingface_hub import split_state_dict_into_shards_factory

    pattern = weights_name.replace(".safetensors", "{suffix}.safetensors")
    return split_state_dict_into_shards_factory(
        specs,
        max_shard_size=max_shard_size,
        filename_pattern=pattern,
        get_storage_size=lambda spec: spec.nbytes,
        get_storage_id=lambda spec: None,
    )


class SafetensorsStreamWriter:
    """One safetensors file; tensors must be written in the order given to the constructor."""

    def __init__(self, path: Path, specs: dict[str, TensorSpec]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, spec in specs.items():
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[str(spec.dtype)],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format asks for 8-byte aligned data
        self._order = list(specs)
        self._specs = specs
        self._next = 0
        self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close(); unbuffered: see write()
        _write_all(self._file.fileno(), struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: Any) -> None:
        expected = self._order[self._next]
        spec = self._specs[name]
        if isinstance(tensor, FileRanges):  # copied by the kernel; the file position is the fd's own (unbuffered)
            if name != expected or tensor.nbytes != spec.nbytes:
                raise RuntimeError(f"internal: got {name} as {tensor.nbytes} bytes, planned {expected} {spec}")
            copy_ranges(tensor.ranges, self._file.fileno())
        else:
            if name != expected or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise RuntimeError(
                    f"internal: got {name} {tuple(tensor.shape)} {tensor.dtype}, planned {expected} {spec}"
                )
            _write_all(self._file.fileno(), tensor.detach().contiguous().reshape(-1).view(_byte_dtype()).numpy())
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"internal: wrote {self._next} of {len(self._order)} tensors to {self._file.name}")
        self._file.close()


def _byte_dtype():
    import torch

    return torch.uint8


def write_hf_weights(
    out_dir: Path,
    specs: dict[str, TensorSpec],
    read_batch: Callable[[list[str]], Iterator[tuple[str, Any]]],
    *,
    max_shard_size: int | str,
    weights_name: str = "model.safetensors",
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write all shards; ``read_batch(names)`` yields the tensors of one shard in order, already cast."""
    split = plan_shards(specs, max_shard_size, weights_name=weights_name)
    files = []
    for filename, names in split.filename_to_tensors.items():
        shard_specs = {name: specs[name] for name in names}
        writer = SafetensorsStreamWriter(ConfinedFolder(out_dir).path(filename), shard_specs)
        for name, tensor in read_batch(list(names)):
            writer.write(name, tensor)
            if progress is not None:
                progress(specs[name].nbytes)
        writer.close()
        files.append(filename)
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs.values())},
            "weight_map": split.tensor_to_filename,
        }
        ConfinedFolder(out_dir).path(f"{weights_name}.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )
    return files


@contextlib.contextmanager
def atomic_output_dir(
    dst: Path,
    *,
    overwrite: bool,
    needed_bytes: int = 0,
    sources: tuple[str | os.PathLike, ...] = (),
) -> Iterator[Path]:
    """Yield a temporary sibling of ``dst``; on success it replaces ``dst``, on any error it is removed.

    ``dst`` passes :func:`hf_dist.checkpoint.output.paths.check_output_path` first (never the source, a folder around
    or inside it, a training checkpoint, or with ``overwrite`` anything but a previous output) and its file system
    must have ``needed_bytes`` free; the folder is then built by :func:`hf_dist.atomic_io.atomic_dir` and marked as
    an output (``hf_dist_output.json``).
    """
    from hf_dist.checkpoint.output.paths import check_output_path, format_bytes, make_parent, mark_output

    dst = check_output_path(dst, sources=sources, overwrite=overwrite)
    make_parent(dst)
    free = shutil.disk_usage(dst.parent).free
    if needed_bytes and free < needed_bytes:
        raise RuntimeError(
            f"not enough disk space in {dst.parent}: the output needs {format_bytes(needed_bytes)}, "
            f"{format_bytes(free)} free; free space or choose another DST"
        )
    with atomic_dir(dst, overwrite=overwrite) as tmp:
        yield tmp
        mark_output(tmp, "hf-dist convert", source=sources[0] if sources else None)
