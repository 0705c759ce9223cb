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


MATH = "arithmetic, not a path"
RUN = "the run's output_dir or the user's own argument: never a checkpoint folder or a name read from a file"
# Every join in hf_dist/checkpoint (``a / b`` with any b, os.path.join, .joinpath, Path(a, b)): a checkpoint or model
# folder's files, read or written, are reached only through ConfinedFolder.path (safety/paths.py). What is left is
# listed here with why it is not a checkpoint path; a new join fails this test until it goes through the folder object
# or is reviewed here.
REVIEWED_JOINS = {
    ("formats/deepspeed.py", "math.prod(shape) / world_size"): MATH,
    ("formats/deepspeed.py", "math.prod(shape) / self.world_size"): MATH,
    ("conversion/transform.py", "alpha / math.sqrt(r)"): MATH,
    ("conversion/transform.py", "alpha / r"): MATH,
    ("conversion/convert.py", "self.total_bytes / 1000000000.0"): MATH,
    ("lifecycle/async_save.py", "available / GIB"): MATH,
    ("lifecycle/async_save.py", "need / GIB"): MATH,
    ("output/paths.py", "count / scale"): MATH,
    ("safety/paths.py", "Path(self.root, name)"): "ConfinedFolder.path itself",
    ("safety/paths.py", "Path(folder) / name"): "check_tree_confined: a name listed by os.walk, checked by confined()",
    ("lifecycle/manifest.py", "rel_top.joinpath(name)"): "a relative name listed by os.walk, made a path by _listed "
    "(ConfinedFolder.path)",
    ("lifecycle/reshard.py", "os.path.join(str(dst), '')"): "its own temporary folder, + a separator",
    ("output/lock.py", "Path(output_dir) / OUTPUT_LOCK"): RUN,
    ("output/lock.py", "output_dir / OUTPUT_LOCK"): RUN,
    ("output/runs.py", "Path(output_dir) / RUN_JOURNAL"): RUN,
    ("output/paths.py", "Path(folder) / OUTPUT_MARKER"): RUN,
    ("output/paths.py", "raw / 'config.yaml'"): RUN,
    ("output/paths.py", "raw / OUTPUT_MARKER"): RUN,
    ("output/paths.py", "src.parent / 'hf-model'"): RUN,
    ("output/paths.py", "raw.parent / (raw.name + '-hf')"): RUN,
    ("output/paths.py", "src.parent / (src.name + '-hf')"): RUN,
}


_PATHS = ("Path", "PurePath", "PurePosixPath")


def _joins(root: Path, *, files_only: bool = False, skip: str | None = None) -> set[tuple[str, str]]:
    """Every ``a / b``, ``os.path.join``, ``.joinpath`` and ``Path(a, b)`` under ``root`` (but in folder ``skip``), as
    (file, source). ``files_only``: an ``a / b`` only when one side names a file (arithmetic left out)."""
    import ast

    found = set()
    for path in sorted(root.rglob("*.py")):
        if skip in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            divided = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            divided = divided and (not files_only or _names_a_file(node.left) or _names_a_file(node.right))
            call = ast.unparse(node.func) if isinstance(node, ast.Call) else ""
            joined = call == "os.path.join" or call.endswith(".joinpath") or (call in _PATHS and len(node.args) > 1)
            if divided or joined:
                found.add((path.relative_to(root).as_posix(), ast.unparse(node)))
    return found


def _names_a_file(node) -> bool:
    """A string, an f-string or a ``Path(...)``/``str(...)`` call."""
    import ast

    text = isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))
    return text or (isinstance(node, ast.Call) and ast.unparse(node.func) in ("Path", "str"))


def test_every_join_in_the_checkpoint_package_is_reviewed():
    """A checkpoint's files are reached only through ConfinedFolder: any other join is listed above, with why it builds
    no checkpoint path. A new join fails here until it goes through the folder object or is reviewed."""
    root = Path(__file__).resolve().parents[4] / "hf_dist" / "checkpoint"
    found = _joins(root)
    assert found - set(REVIEWED_JOINS) == set(), "unreviewed joins: use ConfinedFolder.path, or review and list them"
    assert set(REVIEWED_JOINS) - found == set(), "reviewed joins no longer in the code: drop them from the list"


OUTPUT = "a file hf_dist writes into a run's output_dir, a temporary folder or a cache of its own: no checkpoint"
MESSAGE = "a path shown in a message, never opened"
USER_MODEL = ("the model folder the planner reads: a hub cache snapshot links its files into ../../blobs, so it is "
              "not confined (a checkpoint's side files are: formats/hf.py side_file)")  # fmt: skip
# Joins elsewhere in hf_dist that name a file (a string, an f-string or a Path(...) on one side, os.path.join,
# .joinpath, Path(a, b)): none reaches into a checkpoint but through ConfinedFolder.
REVIEWED_ELSEWHERE = {
    ("atomic_io.py", "where / f'.{final.name}.tmp-{os.getpid()}'"): OUTPUT,
    ("bench.py", "Path(tmp) / 'result.json'"): OUTPUT,
    ("bench.py", "Path(args.out).parent / 'trainer'"): OUTPUT,
    ("callbacks/export.py", "Path(args.output_dir) / f'checkpoint-{state.global_step}'"): OUTPUT,
    ("callbacks/export.py", "Path(args.output_dir) / self.name"): OUTPUT,
    ("callbacks/profiler.py", "folder / f'rank{rank}.{time.time_ns()}.pt.trace.json'"): OUTPUT,
    ("callbacks/profiler.py", "os.path.join(args.output_dir, 'profiler')"): OUTPUT,
    ("callbacks/profiler.py", "folder / f'summary_rank{rank}.json'"): OUTPUT,
    ("callbacks/resume.py", "Path(args.output_dir) / f'checkpoint-{state.global_step}'"): OUTPUT,
    ("callbacks/resume.py", "Path(args.output_dir) / f'checkpoint-{step}'"): OUTPUT,
    ("callbacks/resume.py", "run_dir / f'checkpoint-{step}'"): OUTPUT,
    ("callbacks/resume.py", "Path(trainer._get_output_dir(trial)) / f'checkpoint-{trainer.state.global_step}'"): OUTPUT,
    ("callbacks/watchdog.py", "Path(args.output_dir) / 'hang'"): OUTPUT,
    ("callbacks/watchdog.py", "self._out / str(step)"): OUTPUT,
    ("callbacks/watchdog.py", "folder / f'rank{rank}.txt'"): OUTPUT,
    ("configs/accelerate.py", "Path(args.write_shipped) / name"): OUTPUT,
    ("data/loading.py", "path / 'dataset_info.json'"): "a dataset folder (datasets.load_from_disk reads it)",
    ("data/loading.py", "path / 'dataset_dict.json'"): "a dataset folder (datasets.load_from_disk reads it)",
    ("demo.py", "REPO_ROOT / 'recipes' / 'sft.py'"): "the repository's own recipe",
    ("demo.py", "REPO_ROOT / 'recipes'"): "the repository's own recipe",
    ("planning/feature_store.py", "Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache') / 'hf_dist'"):
        OUTPUT,
    ("planning/feature_store.py", "cache_dir() / f'features-{digest}.json'"): OUTPUT,
    ("planning/feature_store.py", "Path.home() / '.cache'"): OUTPUT,
    ("planning/features.py", "Path(loc) / relative"): "an installed package's own file",
    ("planning/model_source.py", "os.path.join(path_or_name, 'config.json')"): USER_MODEL,
    ("planning/remote_code.py", "os.path.join(source, 'config.json')"): MESSAGE,
    ("planning/remote_code.py", "os.path.join(os.path.abspath(source), module_file)"): MESSAGE,
    ("recipe_utils/model.py", "Path(args.output_dir) / 'base'"): OUTPUT,
    ("recipe_utils/run.py", "Path(args.output_dir) / 'results.json'"): OUTPUT,
    ("recipe_utils/run.py", "Path(trainer.args.output_dir) / ('adapter' if adapter else 'final')"): OUTPUT,
    ("recipe_utils/run.py", "Path(trainer.args.output_dir) / 'results.json'"): OUTPUT,
    ("testing.py", "os.path.join(os.path.dirname(torch.__file__), 'lib', 'libc10.so')"): "torch's own library",
    ("tracing/api.py", "Path(tmp) / 'request.json'"): OUTPUT,
    ("tracing/api.py", "Path(tmp) / 'result.json'"): OUTPUT,
}  # fmt: skip


def test_every_join_naming_a_file_elsewhere_in_hf_dist_is_reviewed():
    """Outside the checkpoint package, a join that names a file is listed above with the folder it is in: none is a
    checkpoint's (export's ``checkpoint / name``, reshard's ``latest_universal`` go through ConfinedFolder)."""
    found = _joins(Path(__file__).resolve().parents[4] / "hf_dist", files_only=True, skip="checkpoint")
    assert found - set(REVIEWED_ELSEWHERE) == set(), "unreviewed joins: use ConfinedFolder.path, or review them"
    assert set(REVIEWED_ELSEWHERE) - found == set(), "reviewed joins no longer in the code: drop them from the list"


WRITES = "writes a folder of its own (a save under way, a converted output, an export): there is no opened checkpoint"
DETECTS = "reads the file names that make the layout, before there is an opened checkpoint to hand on"
# The modules that build a ConfinedFolder themselves. A checkpoint that is read (convert, verify, reshard, auto_resume,
# the proof, the best-model check, the readers) is opened once by open_checkpoint and the object is handed on.
BUILDS_A_FOLDER_OBJECT = {
    "checkpoint/safety/paths.py": "the folder object itself",
    "checkpoint/formats/checkpoint_folder.py": "open_checkpoint: the one opened checkpoint (files, data, manifest)",
    "checkpoint/formats/contents.py": DETECTS,
    "checkpoint/formats/names.py": DETECTS,
    "checkpoint/formats/trainer_state.py": "the one parser of trainer_state.json, also read while the layout is detected",
    "checkpoint/formats/hf.py": "side files and --model-config: folders beside the checkpoint, each its own bound",
    "checkpoint/safety/dcp_metadata.py": "DCP metadata, also read by DCP's own loader during a Trainer resume",
    "checkpoint/safety/trainer_loads.py": "the Trainer's own loads of a checkpoint it names: no opened checkpoint",
    "checkpoint/lifecycle/manifest.py": WRITES,
    "checkpoint/lifecycle/model_config.py": WRITES,
    "checkpoint/lifecycle/reshard.py": WRITES,
    "checkpoint/lifecycle/sharded_state.py": WRITES,
    "checkpoint/conversion/convert.py": WRITES,
    "checkpoint/write/hf_folder.py": WRITES,
    "checkpoint/write/dcp.py": WRITES,
    "callbacks/export.py": WRITES,
    "cli/reshard.py": WRITES,
    "recipe_utils/export.py": WRITES,
}


def test_a_checkpoint_that_is_read_is_opened_once_and_handed_on():
    """Every module that builds a ``ConfinedFolder`` of its own is listed above with why; the readers, the proof, the
    resume checks and verify take the opened checkpoint instead. A new module building one fails here."""
    import ast

    root = Path(__file__).resolve().parents[4] / "hf_dist"
    building = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ConfinedFolder":
                building.add(path.relative_to(root).as_posix())
    assert building - set(BUILDS_A_FOLDER_OBJECT) == set(), "take the opened checkpoint (open_checkpoint) instead"
    assert set(BUILDS_A_FOLDER_OBJECT) - building == set(), "no longer builds one: drop it from the list"


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


@pytest.mark.parametrize("name", ["latest", "trainer_state.json", "config.json"])
def test_a_name_of_hf_dists_own_that_links_out_is_refused_like_a_name_read_from_a_file(name, tmp_path, capsys):
    """hf_dist's own names (``latest``, ``trainer_state.json``, ``config.json``) reach a checkpoint's files through
    the same folder object: the layout reader refuses one that is a link out, naming the link and its target (it
    used to read ``latest`` through the link, and to take the folder around a DCP folder holding a linked
    ``config.json`` for the checkpoint), and ``convert`` refuses it in one line, writing nothing."""
    from hf_dist.checkpoint.formats.contents import read_contents

    ckpt = tmp_path / "run" / "checkpoint-3"
    inner = ckpt / ("global_step3" if name == "latest" else "pytorch_model_fsdp_0")
    inner.mkdir(parents=True)
    if name == "latest":
        (inner / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
        (inner / "mp_rank_00_model_states.pt").write_bytes(b"x")
    else:
        (inner / ".metadata").write_bytes(b"x")
        (inner / "__0_0.distcp").write_bytes(b"x")
    secret = tmp_path / "secret"
    secret.write_text("global_step3" if name == "latest" else "{}")
    (ckpt / name).symlink_to(secret)
    with pytest.raises(PathEscapeError, match=rf"refusing to read {ckpt / name}.*resolves to {secret}"):
        read_contents(ckpt if name == "latest" else inner)
    assert main(["convert", str(ckpt), str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refusing to read" in err, err
    assert str(ckpt / name) in err and str(secret) in err
    assert not (tmp_path / "out").exists()
