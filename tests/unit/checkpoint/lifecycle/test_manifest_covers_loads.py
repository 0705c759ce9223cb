"""The manifest hashes exactly what the loaders read (issue 38, finding 5): a tag folder reached through a link
inside the checkpoint, and the folder ``latest`` names whatever its name, are listed and hashed; a link leaving the
checkpoint is refused naming both; a ``latest`` naming a hidden or temporary folder is refused. Each attack changes
the optimizer shards after the manifest was written."""

from __future__ import annotations

import json
import shutil

import pytest

from hf_dist.checkpoint.formats.checkpoint_folder import load_manifest
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.manifest import checkpoint_files, incomplete_reasons, is_complete
from hf_dist.checkpoint.lifecycle.reshard import reshard
from hf_dist.checkpoint.safety.paths import PathEscapeError
from hf_dist.cli.main import main
from tests.unit.checkpoint.fakes import make_trainer_zero_checkpoint, seal

SHARD = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _change(shard):
    """Same size, other content: only the hash can tell."""
    data = bytearray(shard.read_bytes())
    data[-20:] = bytes(20)
    shard.write_bytes(bytes(data))


def test_a_tag_folder_linked_to_a_temporary_folder_is_hashed_through_the_link(tmp_path, tiny_state, capsys):
    """``global_step4 -> .data.tmp``: the loaders read the shards through the link, so the manifest lists them; when
    they change after the manifest the checkpoint is not complete, auto_resume takes the older one, convert refuses."""
    make_trainer_zero_checkpoint(tmp_path, tiny_state, 2)
    seal(tmp_path / "checkpoint-2", world_size=2, step=2)
    ckpt = make_trainer_zero_checkpoint(tmp_path, tiny_state, 4)
    (ckpt / "global_step4").rename(ckpt / ".data.tmp")
    (ckpt / "global_step4").symlink_to(".data.tmp", target_is_directory=True)
    seal(ckpt, world_size=2, step=4)
    listed = set(load_manifest(ckpt).data["files"])
    assert f"global_step4/{SHARD}" in listed and not any(f.endswith(".json") for f in listed if "/" in f)
    assert is_complete(ckpt) and auto_resume(tmp_path, announce=False) == str(ckpt)  # control: it is taken

    _change(ckpt / ".data.tmp" / SHARD)
    assert f"global_step4/{SHARD} differs from the manifest (SHA-256; same size, other content)" in incomplete_reasons(
        ckpt
    )
    assert auto_resume(tmp_path, announce=False) == str(tmp_path / "checkpoint-2")
    out = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not match its hf_dist_complete.json" in err and SHARD in err, err
    assert not out.exists()


def test_latest_naming_a_temporary_folder_is_listed_and_refused(tmp_path, tiny_state, capsys):
    """``latest`` names ``.global_step4.tmp``: the manifest lists that folder's shards (not only the JSON files), and
    reading the checkpoint refuses the tag: auto_resume (at the same and at another world size), reshard (in place and
    into a copy), convert and the manifest check, in one line each."""
    ckpt = make_trainer_zero_checkpoint(tmp_path, tiny_state, 4)
    (ckpt / "global_step4").rename(ckpt / ".global_step4.tmp")
    (ckpt / "latest").write_text(".global_step4.tmp")
    assert f".global_step4.tmp/{SHARD}" in checkpoint_files(ckpt)
    (ckpt / "hf_dist_complete.json").write_text(json.dumps({  # as an attacker writes it: matching the disk
        "version": 2, "world_size": 2, "step": 4, "files": {
            rel: {"size": (ckpt / rel).stat().st_size, "sha256": __import__("hashlib").sha256(
                (ckpt / rel).read_bytes()).hexdigest()} for rel in checkpoint_files(ckpt)}}))  # fmt: skip
    _change(ckpt / ".global_step4.tmp" / SHARD)
    said = rf"{ckpt / 'latest'}: it names '.global_step4.tmp', a hidden or temporary folder"
    with pytest.raises(PathEscapeError, match=said):
        incomplete_reasons(ckpt)
    with pytest.raises(PathEscapeError, match=said):
        auto_resume(tmp_path, announce=False)
    with pytest.raises(PathEscapeError, match=said):  # resuming on another world size: the reshard path
        auto_resume(tmp_path, world_size=3, announce=False)
    for copy in (None, tmp_path / "copy"):
        with pytest.raises(PathEscapeError, match=said):
            reshard(ckpt, copy)
    assert not (tmp_path / "copy").exists()
    out = tmp_path / "hf"
    assert main(["convert", str(ckpt), str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a hidden or temporary folder" in err, err
    assert not out.exists()


@pytest.mark.parametrize("name", ["global_step4", "extra"])
def test_a_linked_folder_leading_out_is_refused_naming_both(name, tmp_path, tiny_state):
    """The tag folder ``latest`` names, or any other folder, linked outside: no manifest is written over it."""
    ckpt = make_trainer_zero_checkpoint(tmp_path, tiny_state, 4)
    outside = tmp_path / "elsewhere"
    if name == "global_step4":
        shutil.move(ckpt / "global_step4", outside)
    else:
        outside.mkdir()
        (outside / "secret.pt").write_bytes(b"x")
    (ckpt / name).symlink_to(outside, target_is_directory=True)
    with pytest.raises(PathEscapeError, match=rf"refusing to read {ckpt / name}\b.*resolves to {outside}"):
        seal(ckpt, world_size=2, step=4)
    assert not (ckpt / "hf_dist_complete.json").exists()
