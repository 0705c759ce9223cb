"""Every name read from a file stays inside its folder (issue 38): an HF index's ``weight_map``, a manifest's entries,
DCP storage entries, ``latest``, a ``ds_id`` all become paths only through ``ConfinedFolder.path``.

The attacker hands over an HF folder whose index names another model on the disk (``../other/...``, an absolute
path, a link leading out); ``convert`` must not copy that model into its output and ``verify`` must not read it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.safety.paths import ConfinedFolder, PathEscapeError
from hf_dist.cli.main import main
from tests.unit.checkpoint.fakes import seal

WEIGHTS = {"safetensors": "model.safetensors", "bin": "pytorch_model.bin"}


def _save(state: dict, path: Path) -> None:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(state, path)


def _indexed_folder(tmp_path: Path, tiny_state, kind: str, attack: str) -> tuple[Path, Path, str]:
    """An HF folder whose index names the other model's shard by ``attack``; returns (folder, its index, the name)."""
    config, state = tiny_state
    other = tmp_path / "other"  # someone else's model on the same disk
    other.mkdir()
    _save(state, other / WEIGHTS[kind])
    folder = tmp_path / "handed"
    folder.mkdir()
    config.save_pretrained(folder)
    if attack == "..":
        name = f"../other/{WEIGHTS[kind]}"
    elif attack == "absolute":
        name = str(other / WEIGHTS[kind])
    else:  # a shard inside that is a link to the other model
        name = f"shard-00001.{kind}"
        (folder / name).symlink_to(other / WEIGHTS[kind])
    index = folder / f"{WEIGHTS[kind]}.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(state, name)}))
    return folder, index, name


@pytest.mark.parametrize("attack", ["..", "absolute", "link"])
@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_an_index_naming_a_file_outside_is_refused_by_convert_and_verify(kind, attack, tmp_path, tiny_state, capsys):
    folder, index, name = _indexed_folder(tmp_path, tiny_state, kind, attack)
    for argv in (
        ["convert", str(folder), str(tmp_path / "out"), "--no-progress"],
        ["verify", str(folder), str(folder)],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "refusing to read" in err
        assert (str(tmp_path / "other") in err) if attack == "link" else (str(index) in err and repr(name) in err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name", ["../x.safetensors", "a/../../x.safetensors", "/etc/passwd", "..", "", 3, None, ["a"], "a\\..\\x"]
)
def test_confined_folder_refuses_names_that_leave_it(name, tmp_path):
    with pytest.raises(PathEscapeError, match=rf"refusing to read .*: {tmp_path / 'index.json'} names"):
        ConfinedFolder(tmp_path).path(name, named_in=tmp_path / "index.json")


def test_confined_folder_follows_links_only_inside(tmp_path):
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "root" / "sub" / "real.bin").write_bytes(b"x")
    (tmp_path / "secret").write_bytes(b"y")
    root = ConfinedFolder(tmp_path / "root")
    (tmp_path / "root" / "inside.bin").symlink_to(tmp_path / "root" / "sub" / "real.bin")
    (tmp_path / "root" / "out.bin").symlink_to(tmp_path / "secret")
    (tmp_path / "root" / "dir").symlink_to(tmp_path, target_is_directory=True)
    assert root.path("sub/real.bin") == tmp_path / "root" / "sub" / "real.bin"
    assert root.path("inside.bin").read_bytes() == b"x"
    for name in ("out.bin", "dir/secret"):
        with pytest.raises(PathEscapeError, match=rf"{tmp_path / 'root' / name} .*resolves to {tmp_path / 'secret'}"):
            root.path(name, named_in="m.json")
    with pytest.raises(AttributeError):
        root.root = tmp_path  # immutable: a folder object is never re-rooted


def test_a_manifest_listing_a_link_that_leads_out_is_refused_before_hashing(tmp_path):
    """A manifest that matches, as an attacker would write it, listing a link to a file outside: refused, naming the
    link and its target (a ``..`` entry is already a malformed manifest, skipped with its reason)."""
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "secret").write_bytes(b"y" * 7)
    (ckpt / "extra.bin").write_bytes(b"y" * 7)
    seal(ckpt, step=3)  # hf_dist refuses to write a manifest over a link out: the attacker swaps the file after
    (ckpt / "extra.bin").unlink()
    (ckpt / "extra.bin").symlink_to(tmp_path / "secret")
    with pytest.raises(
        PathEscapeError, match=rf"refusing to read {ckpt / 'extra.bin'}.*resolves to {tmp_path}/secret"
    ):
        auto_resume(ckpt.parent)


OWN = "a name of hf_dist's own (a constant or pattern of formats/names.py)"
TAG = "a DeepSpeed tag: listed from the folder or checked by checked_tag (ConfinedFolder)"
LISTED = "a name listed from the folder, or one hf_dist writes into its output"
MATH = "arithmetic, not a path"
# Every ``a / b`` (b not a literal or an UPPERCASE constant) and os.path.join in hf_dist/checkpoint, reviewed: a new
# one fails this test until it is listed here with why its name is not read from a file (or it uses ConfinedFolder).
REVIEWED_JOINS = {
    ("formats/deepspeed.py", "math.prod(shape) / world_size"): MATH,
    ("formats/deepspeed.py", "math.prod(shape) / self.world_size"): MATH,
    ("formats/hf.py", "Path(folder) / name"): "side_file: a constant name, then confined by ConfinedFolder",
    ("formats/hf.py", "out_dir / file.name"): LISTED,
    ("formats/names.py", "tag_dir / f'mp_rank_{mp_rank:02d}_model_states.pt'"): OWN,
    ("formats/contents.py", "path / _choose_tag(path, tag, tag_dirs)"): TAG,
    ("formats/contents.py", "path / name"): OWN,
    ("formats/contents.py", "root / tag"): TAG,
    ("formats/contents.py", "root / name"): OWN,
    ("formats/contents.py", "path / nested[-1]"): LISTED,
    ("lifecycle/manifest.py", "folder / rel"): "entries(): names listed from the folder by checkpoint_files",
    ("lifecycle/manifest.py", "here / name"): "checkpoint_files: listed by os.walk, links confined (_is_link_out)",
    ("lifecycle/manifest.py", "rel_top / name"): "checkpoint_files: listed by os.walk, links confined (_is_link_out)",
    ("lifecycle/proof.py", "folder / tag"): TAG,
    ("lifecycle/proof.py", "folder / name"): OWN,
    ("lifecycle/reshard.py", "layout.root / f'{layout.tag}{UNIVERSAL_SUFFIX}'"): TAG,
    ("lifecycle/reshard.py", "layout.root / layout.universal_tag"): TAG,
    ("lifecycle/reshard.py", "os.path.join(str(dst), '')"): LISTED,  # its own temporary folder, + a separator
    ("lifecycle/sharded_state.py", "Path(checkpoint_dir) / name"): OWN,
    ("output/paths.py", "count / scale"): MATH,
    ("output/paths.py", "raw.parent / (raw.name + '-hf')"): "the user's own argument",
    ("output/paths.py", "src.parent / (src.name + '-hf')"): "the user's own argument",
    ("safety/paths.py", "Path(self.root) / name"): "ConfinedFolder.path itself",
    ("safety/paths.py", "self.root / name"): "ConfinedFolder.path's message",
    ("safety/paths.py", "Path(folder) / name"): "check_tree_confined: listed by os.walk",
    ("safety/paths.py", "Path(root) / source"): "checked_tag: the name of the latest file (a constant)",
    ("conversion/transform.py", "alpha / math.sqrt(r)"): MATH,
    ("conversion/transform.py", "alpha / r"): MATH,
    ("write/dcp.py", "tmp / files[-1]"): LISTED,
    ("write/hf_folder.py", "out_dir / filename"): LISTED,
    ("write/hf_folder.py", "out_dir / f'{weights_name}.index.json'"): LISTED,
}


def _joins(root: Path) -> set[tuple[str, str]]:
    import ast

    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            right = node.right if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) else None
            literal = isinstance(right, ast.Constant) or (isinstance(right, ast.Name) and right.id.isupper())
            literal = literal or (isinstance(right, ast.JoinedStr) and all(isinstance(v, ast.Constant)
                                                                         for v in right.values))  # fmt: skip
            joined = isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join"
            if (right is not None and not literal) or joined:
                found.add((path.relative_to(root).as_posix(), ast.unparse(node)))
    return found


def test_every_join_in_the_checkpoint_package_is_reviewed():
    """A name read from a file reaches a path only through ConfinedFolder: any other join is listed above, with why
    its name is not read from a file. A new join fails here until it is reviewed."""
    root = Path(__file__).resolve().parents[4] / "hf_dist" / "checkpoint"
    found = _joins(root)
    assert found - set(REVIEWED_JOINS) == set(), "unreviewed joins: use ConfinedFolder, or review and list them"
    assert set(REVIEWED_JOINS) - found == set(), "reviewed joins no longer in the code: drop them from the list"


@pytest.mark.parametrize(
    "index, said",
    [
        ('{"metadata": {}}', 'has no "weight_map" object .*got none'),
        ("[1, 2]", "holds a JSON list, expected an object"),
        ("7", "holds a JSON int, expected an object"),
        ('{"weight_map": ["model.safetensors"]}', 'has no "weight_map" object .*got a list'),
        ('{"weight_map": {}}', 'has no "weight_map" object .*got a dict'),
        ('{"weight_map": {"lm_head.weight": 3}}', r"weight_map maps 'lm_head.weight' to 3, not a shard file name"),
        ('{"weight_map": {"lm_head.weight": null}}', r"weight_map maps 'lm_head.weight' to None, not a shard"),
        ('{"weight_map": ', "is not valid JSON"),
        ("", "is empty"),
    ],
)
def test_an_index_of_the_wrong_shape_is_one_line(index, said, tmp_path, tiny_state, capsys):
    config, state = tiny_state
    folder = tmp_path / "handed"
    folder.mkdir()
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(index)
    for argv in (
        ["convert", str(folder), str(tmp_path / "out"), "--no-progress"],
        ["verify", str(folder), str(folder)],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert re.search(rf"{folder / 'model.safetensors.index.json'}:? {said}", err), err
    assert not (tmp_path / "out").exists()
