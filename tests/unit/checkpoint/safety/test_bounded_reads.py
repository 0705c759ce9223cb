"""Every length read from a file is checked against the file's size before anything is allocated (issue 38): a DCP
``.metadata`` claiming 2**40 bytes (a pickle frame, bytes, a bytearray, a string) gives one line from ``convert`` and
``verify``, nothing written, and ``auto_resume`` skips that checkpoint naming why, never a bare ``MemoryError``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.safety.errors import CorruptCheckpointError
from hf_dist.checkpoint.safety.loading import guarded_loads
from hf_dist.cli.main import main
from tests.unit.checkpoint.fakes import seal
from tests.unit.checkpoint.safety.test_entry_points import _dcp_run

HUGE = (2**40).to_bytes(8, "little")
CLAIMS = {
    "frame": b"\x80\x04\x95" + HUGE + b"N.",
    "bytes8": b"\x80\x04\x8e" + HUGE + b"abc.",
    "bytearray8": b"\x80\x05\x96" + HUGE + b"abc.",
    "unicode8": b"\x80\x04\x8d" + HUGE + b"abc.",
}


def _claim(ckpt: Path, kind: str) -> Path:
    metadata = ckpt / "pytorch_model_fsdp_0" / ".metadata"
    metadata.write_bytes(CLAIMS[kind])
    return metadata


@pytest.mark.parametrize("kind", sorted(CLAIMS))
def test_metadata_claiming_a_huge_length_is_one_line_from_convert_and_verify(kind, tmp_path, tiny_state, capsys):
    ckpt = _dcp_run(tmp_path, tiny_state)
    metadata = _claim(ckpt, kind)
    for argv in (["convert", str(ckpt), str(tmp_path / "out"), "--no-progress"], ["verify", str(ckpt), str(ckpt)]):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "MemoryError" not in err, err
        assert f"refusing to read DCP metadata {metadata}: " in err and "1099511627776" in err
    assert not (tmp_path / "out").exists()


def test_a_library_load_of_such_metadata_is_refused_under_the_guard(tmp_path, tiny_state):
    import torch.distributed.checkpoint as dcp

    ckpt = _dcp_run(tmp_path, tiny_state)
    _claim(ckpt, "bytes8")
    with pytest.raises(CorruptCheckpointError, match="checked against its 15 bytes"), guarded_loads(ckpt):
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(ckpt / "pytorch_model_fsdp_0")), no_dist=True)


@pytest.mark.parametrize("manifest", [True, False])
def test_auto_resume_skips_such_a_checkpoint_naming_why(manifest, tmp_path, tiny_state, caplog):
    crafted = _dcp_run(tmp_path, tiny_state)  # run/checkpoint-3
    good = crafted.parent / "checkpoint-2"
    shutil.copytree(crafted, good)
    (good / "trainer_state.json").write_text('{"global_step": 2}')
    seal(good, world_size=1, step=2)
    metadata = _claim(crafted, "bytes8")
    if manifest:  # as an attacker would hand it over: a manifest that matches the crafted file
        seal(crafted, world_size=1, step=3)
    with caplog.at_level("WARNING"):
        assert auto_resume(crafted.parent) == str(good)
        assert auto_resume(crafted.parent, world_size=3) == str(good)  # DCP resumes at any world size: same check
    assert f"skipping {crafted}: " in caplog.text
    assert f"refusing to read DCP metadata {metadata}: expected 1099511627776 bytes" in caplog.text
