"""The direct DCP reader: chunks read from memory-mapped .distcp files equal torch's own dcp.load."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint
from hf_dist.checkpoint.formats.dcp import DCPReader
from hf_dist.checkpoint.safety.dcp_metadata import load_metadata
from hf_dist.checkpoint.safety.errors import CorruptCheckpointError


@pytest.fixture
def saved(tmp_path):
    generator = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(6, 4, generator=generator),
        "t": torch.randn(3, 5, generator=generator).t(),  # non-contiguous: saved with its strides
        "i": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(4, 2, generator=generator).to(torch.bfloat16),
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    return tmp_path / "ck", state


def test_direct_read_equals_the_saved_tensors(saved):
    folder, state = saved
    reader = DCPReader(open_checkpoint(folder))
    got = reader.read(list(state))
    reader.release()
    for name, expected in state.items():
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name


def test_multi_chunk_tensor_is_reassembled(saved):
    """Split w's single chunk into three row chunks in the metadata the reader indexes, as 3 ranks save it."""
    folder, state = saved
    reader = DCPReader(open_checkpoint(folder))
    ((offsets, storage),) = reader._chunks["w"]
    full = reader._chunk("w", storage).clone()
    rows = [(0, 2), (2, 3), (5, 1)]
    for i, (start, length) in enumerate(rows):
        piece = folder / f"piece{i}.pt"
        torch.save(full[start : start + length].clone(), piece)
        stub = type(storage)()
        stub.__dict__.update(relative_path=piece.name, offset=0, length=piece.stat().st_size)
        rows[i] = ((start, 0), stub)
    reader._chunks["w"] = rows
    assert torch.equal(reader.read(["w"])["w"], state["w"])


def test_metadata_stand_ins_never_import_torch_distributed(saved):
    folder, _ = saved
    code = (
        "import sys, torch\n"
        "from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint\n"
        "from hf_dist.checkpoint.formats.dcp import DCPReader\n"
        f"r = DCPReader(open_checkpoint({str(folder)!r}))\n"
        "r.read(list(r.specs()))\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_stand_ins_carry_the_same_fields_as_dcp_classes(saved):
    folder, _ = saved
    real = load_metadata(folder)
    inert = load_metadata(folder, stand_ins=True)
    assert type(real).__module__.startswith("torch.distributed.checkpoint")
    assert type(inert).__name__ == "MetadataStub"
    for name, item in real.state_dict_metadata.items():
        stub = inert.state_dict_metadata[name]
        assert (stub.size, stub.properties.dtype) == (item.size, item.properties.dtype)

    def storage(metadata) -> dict:
        return {
            (k.fqn, tuple(k.offset)): (v.relative_path, v.offset, v.length) for k, v in metadata.storage_data.items()
        }

    assert storage(real) == storage(inert)


def test_chunks_with_a_transform_go_through_dcp_load(saved, monkeypatch):
    folder, state = saved
    reader = DCPReader(open_checkpoint(folder))
    monkeypatch.setattr(reader, "_chunk", lambda *a: pytest.fail("direct path used for a transformed chunk"))
    for _, storage in reader._chunks["t"]:
        storage.transform_descriptors = ["zstd"]  # as written by FileSystemWriter(_extensions=[ZStandard()])
    calls = []
    real = DCPReader._read_with_dcp
    monkeypatch.setattr(reader, "_read_with_dcp", lambda names: calls.append(names) or real(reader, names))
    got = reader.read(["t"])
    assert calls == [["t"]] and torch.equal(got["t"], state["t"])


def test_corrupt_chunk_names_file_and_tensor(saved):
    folder, _ = saved
    reader = DCPReader(open_checkpoint(folder))
    ((_, storage),) = reader._chunks["w"]
    data = folder / storage.relative_path
    raw = bytearray(data.read_bytes())
    raw[storage.offset : storage.offset + 64] = b"\0" * 64  # the chunk's zip header
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"cannot read w from .*__0_0\.distcp at byte"):
        reader.read(["w"])


def test_byte_ranges_locate_row_shards_and_refuse_the_rest(saved):
    folder, state = saved
    reader = DCPReader(open_checkpoint(folder))
    ((path, offset, length),) = reader.byte_ranges("w")
    with open(path, "rb") as handle:
        handle.seek(offset)
        raw = handle.read(length)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(6, 4), state["w"])
    assert reader.byte_ranges("t") is None  # saved with transposed strides: not C order on disk
    assert reader.byte_ranges("h") is not None and reader.byte_ranges("i") is not None


def test_non_tensor_values_are_skipped_and_optimizer_folders_named(tmp_path):
    """DCP pickles a non-tensor value's index without an offset; the weights next to it still read. A folder of
    optimizer state is refused with what to convert instead (it was: AttributeError 'MetadataIndexStub')."""
    w = torch.arange(12.0).reshape(3, 4)
    dcp.save({"model": {"w": w}, "step": 3, "groups": [{"lr": 0.1}]}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    reader = DCPReader(open_checkpoint(tmp_path / "ck"))
    assert list(reader._specs) == ["model.w"] and torch.equal(reader.read(["model.w"])["model.w"], w)
    reader.release()
    optimizer = {"state": {"model.w": {"exp_avg": w, "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}
    folder = tmp_path / "checkpoint-3" / "hf_dist_optimizer"
    dcp.save({"optimizer": optimizer}, checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(
        ValueError, match=r"holds optimizer state .* checkpoint folder it belongs to \(.*checkpoint-3\)"
    ):
        DCPReader(open_checkpoint(folder))
