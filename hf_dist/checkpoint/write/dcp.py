"""Write a DCP checkpoint tensor by tensor (HF -> DCP), in the layout ``torch.distributed.checkpoint`` reads.

Each tensor is stored whole (one chunk), serialized exactly as ``FileSystemWriter`` does
(``torch.save`` of the tensor into a ``.distcp`` file at a recorded offset); tensors are spread
over files of about ``file_size`` bytes. Because DCP reshards on load, an FSDP run of any world
size loads it with ``dcp.load({"model": model.state_dict()}, checkpoint_id=DST)`` (names are
nested under ``model.``, the layout accelerate/Trainer use for ``pytorch_model_fsdp_0``), each
rank reading only the slices it owns.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.names import DCP_METADATA, dcp_shard_name
from hf_dist.checkpoint.formats.reader import TensorSpec
from hf_dist.checkpoint.safety.paths import ConfinedFolder
from hf_dist.checkpoint.write.hf_folder import atomic_output_dir

DEFAULT_PREFIX = "model."
FILE_SIZE = 1024**3


def write_dcp(
    dst: Path,
    specs: dict[str, TensorSpec],
    tensors: Iterable[tuple[str, Any]],
    *,
    overwrite: bool = False,
    prefix: str = DEFAULT_PREFIX,
    file_size: int = FILE_SIZE,
    sources: tuple = (),
) -> list[str]:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    files: list[str] = []
    total = sum(s.nbytes for s in specs.values())
    with atomic_output_dir(Path(dst), overwrite=overwrite, needed_bytes=total, sources=sources) as tmp:
        out, handle, written = ConfinedFolder(tmp), None, 0
        for name, tensor in tensors:
            if handle is None or written >= file_size:
                if handle is not None:
                    handle.close()
                files.append(dcp_shard_name(len(files)))
                handle, written = open(out.path(files[-1]), "wb"), 0  # noqa: SIM115 - closed below
            fqn = prefix + name
            zeros = torch.Size([0] * tensor.dim())
            offset = handle.tell()
            torch.save(tensor.detach().contiguous(), handle)
            length = handle.tell() - offset
            written += length
            state_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=tensor.dtype),
                size=tensor.size(),
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=tensor.size())],
            )
            storage[MetadataIndex(fqn=fqn, offset=zeros, index=0)] = _StorageInfo(files[-1], offset, length)
        if handle is not None:
            handle.close()
        if len(state_md) != len(specs):
            raise RuntimeError(f"internal: wrote {len(state_md)} of {len(specs)} tensors")
        with open(out.path(DCP_METADATA), "wb") as meta:
            pickle.dump(Metadata(state_dict_metadata=state_md, storage_data=storage), meta)
    return [*files, DCP_METADATA]
