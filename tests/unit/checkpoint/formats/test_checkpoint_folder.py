"""One checkpoint folder object (issue 38, item 1): ``open_checkpoint`` reads the layout and parses the manifest once,
the object never changes, and every reader reaches its files through the folder object it is handed."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from hf_dist.checkpoint.formats import checkpoint_folder
from hf_dist.checkpoint.formats.checkpoint_folder import open_checkpoint
from hf_dist.checkpoint.formats.contents import read_contents
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.safety.paths import PathEscapeError
from hf_dist.cli.main import main
from tests.unit.checkpoint.fakes import make_trainer_zero_checkpoint, seal

FORMATS = Path(checkpoint_folder.__file__).parent
READERS = ("deepspeed.py", "autotp.py", "dcp.py", "hf.py")


def test_the_opened_checkpoint_holds_root_layout_and_manifest_and_never_changes(tmp_path, tiny_state):
    ckpt = make_trainer_zero_checkpoint(tmp_path, tiny_state, 2)
    written = seal(ckpt, world_size=2, step=2)
    checkpoint = open_checkpoint(ckpt)
    assert checkpoint.root == ckpt and checkpoint.contents == read_contents(ckpt)
    assert checkpoint.manifest.data == json.loads(json.dumps(written)) and checkpoint.manifest.judged
    assert checkpoint.data.root == ckpt / "global_step2" and checkpoint.data.bound == ckpt
    for field in ("files", "contents", "manifest"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(checkpoint, field, None)
    with pytest.raises(PathEscapeError, match="leaves the folder"):
        checkpoint.path("../elsewhere")


def test_resuming_parses_each_checkpoints_manifest_once(tmp_path, tiny_state, monkeypatch):
    """Before, auto_resume parsed a checkpoint's manifest three times (has it one, does it match, which run wrote it)
    and the proof a fourth; now the folder is opened once and every check reads the object."""
    for step in (2, 4):
        seal(make_trainer_zero_checkpoint(tmp_path, tiny_state, step), world_size=2, step=step)
    parsed: list[str] = []
    real_loads = json.loads

    class CountingJson:
        @staticmethod
        def loads(text, *args, **kwargs):
            data = real_loads(text, *args, **kwargs)
            parsed.append(data.get("step") if isinstance(data, dict) else None)
            return data

    monkeypatch.setattr(checkpoint_folder, "json", CountingJson)  # load_manifest is the module's only json reader
    assert auto_resume(tmp_path, world_size=2, announce=False) == str(tmp_path / "checkpoint-4")
    assert parsed == [4]


def test_a_tag_folder_linked_to_a_sibling_inside_is_read_and_one_linked_out_is_refused(tmp_path, tiny_state, capsys):
    """The readers' folder object is confined to the checkpoint's root: a tag folder may be a link to a folder beside
    it inside the checkpoint (the manifest lists its files through the link), never one outside."""
    ckpt = make_trainer_zero_checkpoint(tmp_path, tiny_state, 2)
    (ckpt / "global_step2").rename(ckpt / "data")
    (ckpt / "global_step2").symlink_to("data", target_is_directory=True)
    assert open_checkpoint(ckpt).data.root == ckpt / "global_step2"
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--no-progress"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()

    outside = tmp_path / "elsewhere"
    (ckpt / "data").rename(outside)
    (ckpt / "global_step2").unlink()
    (ckpt / "global_step2").symlink_to(outside, target_is_directory=True)
    capsys.readouterr()
    assert main(["convert", str(ckpt), str(tmp_path / "out2"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "global_step2" in err and str(outside) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out2").exists()


def test_no_reader_builds_a_folder_object_of_its_own():
    """The readers are handed the opened checkpoint and reach every file through ``checkpoint.data``; a reader that
    built ``ConfinedFolder(...)`` from a path would choose its own bound again, which is what this object replaced."""
    for name in READERS:
        tree = ast.parse((FORMATS / name).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Reader")):
            built = [
                f"{name}:{call.lineno}"
                for call in ast.walk(cls)
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "ConfinedFolder"
            ]
            assert not built, f"{cls.name} builds its own ConfinedFolder at {built}; use checkpoint.data"
            init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            assert init.args.args[1].arg == "checkpoint", f"{cls.name}.__init__ takes {init.args.args[1].arg}"


def test_a_folder_not_written_yet_is_not_complete_and_no_best_model(tmp_path):
    """The bookkeeping opens folders leniently: ``checkpoint-2`` polled before its save began, or a
    ``best_model_checkpoint`` that names a folder since deleted, holds nothing; it is never an error."""
    from hf_dist.checkpoint.lifecycle.manifest import incomplete_reasons, is_complete
    from hf_dist.checkpoint.safety.trainer_loads import best_checkpoint_problem

    missing = tmp_path / "checkpoint-2"
    assert not is_complete(missing)
    assert incomplete_reasons(missing) == ["no hf_dist_complete.json (the save did not finish on every rank)"]
    assert open_checkpoint(missing, strict=False).contents.unread.endswith("does not exist")
    assert "has no hf_dist_complete.json" in best_checkpoint_problem(str(missing), tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_checkpoint(missing)  # convert, verify and reshard name it
