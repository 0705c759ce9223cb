"""The CLI driven with a table of bad inputs: each gets a clean error naming what was received, and the
source checkpoint (and the whole run folder around it) is byte-identical afterwards."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from hf_dist.cli.main import main
from tests.unit.checkpoint.fakes import make_zero_checkpoint, tiny_model_state


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links as links) -> content hash; folders and links included."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """run/checkpoint-3 (ZeRO-3), run/checkpoint-2 (another checkpoint), configs, links, a file as a parent."""
    root = tmp_path_factory.mktemp("fuzz")
    config, state = tiny_model_state()
    run = root / "run"
    make_zero_checkpoint(run / "checkpoint-3", config, state, stage=3)
    make_zero_checkpoint(run / "checkpoint-2", config, state, stage=3)
    (run / "checkpoint-3" / "trainer_state.json").write_text('{"global_step": 3}')
    make_zero_checkpoint(run / "checkpoint-4", config, state, stage=3)
    (run / "checkpoint-4" / "generation_config.json").write_text("")
    make_zero_checkpoint(run / "checkpoint-5", config, state, stage=3)
    (run / "checkpoint-5" / "config.json").write_text("")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "loop").symlink_to(root / "loop")
    (root / "afile").write_text("x")
    (root / "adir").mkdir()
    good = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 100}  # fmt: skip
    for name, change in {
        "layers0": {"num_hidden_layers": 0},
        "hidden0": {"hidden_size": 0},
        "heads65": {"hidden_size": 65, "num_attention_heads": 2, "num_key_value_heads": 1},
        "kv3": {"num_key_value_heads": 3},
        "good": {},
    }.items():
        (root / f"{name}.json").write_text(json.dumps({**good, **change}))
    (root / "empty.json").write_text("")
    return root


S = "{root}/run/checkpoint-3"
# (argv with {root} placeholders, expected exit code, text the message must contain ({root} expanded))
CASES = [
    # convert: outputs that would delete or change the checkpoint, overwrite or not
    (["convert", S, S, "--overwrite"], 1, "DST {root}/run/checkpoint-3 is the source"),
    (["convert", S, S], 1, "DST {root}/run/checkpoint-3 is the source"),
    (["convert", S, "{root}/run", "--overwrite"], 1, "DST {root}/run contains the source"),
    (["convert", S, "{root}", "--overwrite"], 1, "DST {root} contains the source"),
    (["convert", S, S + "/hf"], 1, "DST {root}/run/checkpoint-3/hf is inside the source"),
    (["convert", S, S + "/global_step3", "--overwrite"], 1, "is inside the source"),
    (["convert", S, "{root}/run/checkpoint-2", "--overwrite"], 1, "DST {root}/run/checkpoint-2 holds training state"),
    (["convert", S, "{root}/run/checkpoint-2"], 1, "DST {root}/run/checkpoint-2 already exists"),
    (["convert", S, "{root}/dangling"], 1, "DST {root}/dangling is a dangling or looping symbolic link"),
    (["convert", S, "{root}/loop", "--overwrite"], 1, "DST {root}/loop is a dangling or looping symbolic link"),
    (["convert", S, "{root}/afile/out"], 1, "{root}/afile is a file, not a folder"),
    (["convert", S, "{root}/afile", "--overwrite"], 1, "DST {root}/afile exists and is not a folder"),
    (["convert", S, ""], 1, "DST '' is not a usable output name"),
    (["convert", "{root}/missing", "{root}/out"], 1, "{root}/missing does not exist"),
    (["convert", S, "{root}/out", "--dtype", "fp8"], 2, "fp8"),
    (["convert", S, "{root}/out", "--model-config", "{root}/empty.json"], 1, "--model-config {root}/empty.json"),
    # broken side files of the source: named, nothing written
    (
        ["convert", "{root}/run/checkpoint-4", "{root}/out4"],
        1,
        "{root}/run/checkpoint-4/generation_config.json is empty",
    ),
    (["convert", "{root}/run/checkpoint-5", "{root}/out5"], 1, "{root}/run/checkpoint-5/config.json is empty"),
    # reshard: the same output rules, and bad numbers
    (["reshard", S, S, "--overwrite"], 1, "DST {root}/run/checkpoint-3 is the source"),
    (["reshard", S, "{root}/run", "--overwrite"], 1, "DST {root}/run contains the source"),
    (["reshard", S, S + "/copy"], 1, "is inside the source"),
    (["reshard", S, "{root}/run/checkpoint-2", "--overwrite"], 1, "holds training state"),
    (["reshard", S, "{root}/dangling"], 1, "DST {root}/dangling is a dangling"),
    (["reshard", S, "--check", "0"], 1, "got 0"),
    (["reshard", S, "--workers", "0"], 1, "--workers must be >= 1, got 0"),
    (["reshard", "{root}/adir"], 1, "{root}/adir is not a Trainer checkpoint"),
    # verify
    (["verify", S, S, "--atol", "nan"], 1, "--atol must be a finite number >= 0, got nan"),
    (["verify", S, S, "--atol", "-1"], 1, "got -1.0"),
    (["verify", S, "{root}/missing"], 1, "{root}/missing does not exist"),
    # plan: numbers and model configs
    (
        ["plan", "{root}/good.json", "--gpus", "1", "--gpu-memory", "nan"],
        1,
        "gpu_memory_gib must be a finite number > 0, got nan",
    ),
    (["plan", "{root}/good.json", "--gpus", "1", "--gpu-memory", "inf"], 1, "got inf"),
    (
        ["plan", "{root}/good.json", "--gpus", "1", "--gpu-memory", "8", "--host-memory", "-5"],
        1,
        "host_memory_gib must be a finite number > 0, got -5.0",
    ),
    (["plan", "{root}/good.json", "--gpus", "1", "--gpu-memory", "8", "--host-memory", "nan"], 1, "got nan"),
    (
        ["plan", "{root}/good.json", "--gpus", "1", "--gpu-memory", "80", "--safety-margin", "nan"],
        1,
        "safety_margin must be in [0, 1), got nan",
    ),
    (
        ["plan", "{root}/layers0.json", "--gpus", "1", "--gpu-memory", "80"],
        1,
        "num_hidden_layers must be a positive integer, got 0",
    ),
    (
        ["plan", "{root}/hidden0.json", "--gpus", "1", "--gpu-memory", "80"],
        1,
        "hidden_size must be a positive integer, got 0",
    ),
    (["plan", "{root}/heads65.json", "--gpus", "1", "--gpu-memory", "80"], 1, "hidden size (65) is not a multiple"),
    (["plan", "{root}/kv3.json", "--gpus", "1", "--gpu-memory", "80"], 1, "num_key_value_heads (3)"),
    (["plan", "{root}/empty.json", "--gpus", "1", "--gpu-memory", "80"], 1, "{root}/empty.json is not valid JSON"),
    # config --out
    (["config", "--strategy", "ddp", "--out", "{root}/adir"], 1, "--out {root}/adir is a folder"),
    (["config", "--strategy", "ddp", "--out", "{root}/dangling"], 1, "--out {root}/dangling is a dangling"),
    (["config", "--strategy", "ddp", "--out", "{root}/afile/x.yaml"], 1, "{root}/afile is a file, not a folder"),
    (["config", "--strategy", "ddp", "--out", "{root}/afile"], 1, "--out {root}/afile already exists; pass --force"),
]


@pytest.mark.parametrize(("argv", "code", "expected"), CASES, ids=[" ".join(c[0][:4]) for c in CASES])
def test_bad_input_is_a_clean_error_and_changes_nothing(world, capsys, argv, code, expected):
    before = snapshot(world)
    argv = [a.format(root=world) for a in argv]
    if code == 2:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    else:
        assert main(argv) == code
    err = capsys.readouterr().err
    assert expected.format(root=world) in err, err
    assert "Traceback" not in err
    assert snapshot(world) == before  # nothing written, nothing deleted, no temporary left behind


def test_read_only_parent_is_a_clean_error(world, capsys, monkeypatch):
    import hf_dist.checkpoint.output.paths as paths

    monkeypatch.setattr(paths.os, "access", lambda path, mode: False)
    before = snapshot(world)
    assert main(["convert", str(world / "run/checkpoint-3"), str(world / "ro" / "out")]) == 1
    err = capsys.readouterr().err
    assert f"DST {world}/ro/out: cannot write in {world} (read-only or no permission)" in err
    assert snapshot(world) == before


def test_overwrite_replaces_a_previous_output_and_removes_stale_temporaries(world, tmp_path, capsys, caplog):
    src = world / "run" / "checkpoint-3"
    out = tmp_path / "hf"
    stale = tmp_path / ".hf.tmp-999999999"  # a killed run's temporary (no such process)
    stale.mkdir()
    (stale / "model.safetensors").write_text("half")
    before = snapshot(src)
    assert main(["convert", str(src), str(out), "--no-progress"]) == 0
    assert not stale.exists() and f"removed {stale}" in caplog.text
    assert main(["convert", str(src), str(out), "--no-progress", "--overwrite"]) == 0  # a previous output: fine
    assert (out / "model.safetensors").is_file() and snapshot(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
