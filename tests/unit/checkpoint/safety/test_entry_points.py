"""A payload planted in any file of a checkpoint never runs, whichever entry point reads it, in every torch format.

The payload makes a folder when unpickled by a loader that trusts the file (DeepSpeed's ``weights_only=False``, DCP's
``pickle.load``); each test asserts the folder does not exist afterwards. Control tests show the planted files
really execute when loaded without hf_dist, and that the guard alone, with the early check switched off, still
refuses them: safety does not rest on a check beside the load.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_dist.checkpoint.lifecycle import reshard as reshard_module
from hf_dist.checkpoint.lifecycle import resume_checks
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.reshard import prepare_resume, reshard
from hf_dist.checkpoint.safety import loading
from hf_dist.checkpoint.safety.errors import UnsafePickleError
from hf_dist.checkpoint.safety.loading import check_loadable, guarded_loads
from hf_dist.checkpoint.safety.paths import PathEscapeError
from hf_dist.cli.main import main
from hf_dist.recipe_utils.run import resume_checkpoint
from tests.unit.checkpoint.fakes import make_zero_checkpoint, seal
from tests.unit.checkpoint.safety.payloads import ESCAPES, FORMATS, escape, plant, plant_dcp_value, plant_metadata


def _trainer_files(ckpt: Path) -> None:
    for rank in range(2):
        torch.save({"python": None, "cpu": torch.zeros(4, dtype=torch.uint8)}, ckpt / f"rng_state_{rank}.pth")
    torch.save({"last_epoch": 3, "_step_count": 4}, ckpt / "scheduler.pt")
    (ckpt / "trainer_state.json").write_text('{"global_step": 3}')


def _zero_run(tmp_path: Path, tiny_state, stage: int) -> Path:
    config, state = tiny_state
    ckpt = tmp_path / "run" / "checkpoint-3"
    make_zero_checkpoint(ckpt, config, state, stage=stage)
    _trainer_files(ckpt)
    return ckpt


def _dcp_run(tmp_path: Path, tiny_state) -> Path:
    from hf_dist.checkpoint.formats.reader import TensorSpec
    from hf_dist.checkpoint.write.dcp import write_dcp

    config, state = tiny_state
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    config.save_pretrained(ckpt)
    specs = {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state.items()}
    write_dcp(ckpt / "pytorch_model_fsdp_0", specs, iter(state.items()))
    _trainer_files(ckpt)
    return ckpt


def _fsdp_full_run(tmp_path: Path, tiny_state) -> Path:
    config, state = tiny_state
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    config.save_pretrained(ckpt)
    torch.save(dict(state), ckpt / "pytorch_model_fsdp.bin")
    _trainer_files(ckpt)
    return ckpt


# (checkpoint builder, planted file relative to checkpoint-3)
KINDS = {
    "zero2 model states": ("zero2", "global_step3/mp_rank_00_model_states.pt"),
    "zero2 optimizer states": ("zero2", "global_step3/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "zero3 model states": ("zero3", "global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt"),
    "dcp .metadata": ("dcp", "pytorch_model_fsdp_0/.metadata"),
    "dcp non-tensor value in .distcp": ("dcp", "optimizer_0/__0_0.distcp"),
    "pytorch_model_fsdp.bin": ("fsdp_full", "pytorch_model_fsdp.bin"),
    "rng_state_1.pth": ("dcp", "rng_state_1.pth"),
    "scheduler.pt": ("zero3", "scheduler.pt"),
}
DCP_FILES = (".metadata", ".distcp")
CASES = [(kind, "zip") for kind in sorted(KINDS)] + [
    (kind, fmt) for kind in sorted(KINDS) for fmt in FORMATS[1:] if not KINDS[kind][1].endswith(DCP_FILES)
]
# what the refusal names, per format: the global torch's unpickler refused, or the format it will not unpickle
NAMED = {"zip": "posix.mkdir", "two directories": "posix.mkdir", "legacy": "posix.mkdir", "tar": "legacy tar"}


def _build(kind: str, tmp_path: Path, tiny_state, fmt: str = "zip") -> tuple[Path, Path, Path]:
    """(checkpoint, planted file, marker path the payload would create); the checkpoint is marked complete."""
    layout, rel = KINDS[kind]
    builders = {
        "zero2": lambda: _zero_run(tmp_path, tiny_state, 2),
        "zero3": lambda: _zero_run(tmp_path, tiny_state, 3),
        "dcp": lambda: _dcp_run(tmp_path, tiny_state),
        "fsdp_full": lambda: _fsdp_full_run(tmp_path, tiny_state),
    }
    ckpt = builders[layout]()
    marker = tmp_path / "PAYLOAD_RAN"
    planted = ckpt / rel
    if planted.name == ".metadata":
        plant_metadata(planted, marker)
    elif planted.suffix == ".distcp":
        plant_dcp_value(planted.parent, marker)
    else:
        plant(planted, marker, fmt)
    # a valid, matching marker: authenticity is not what the marker proves, the loads must still refuse
    seal(ckpt, world_size=2 if layout.startswith("zero") else 1, step=3)
    return ckpt, planted, marker


def _ds_args(stage: int) -> SimpleNamespace:
    config = {"zero_optimization": {"stage": stage}}
    plugin = SimpleNamespace(deepspeed_config=config, hf_ds_config=SimpleNamespace(config=config))
    return SimpleNamespace(deepspeed=config, fsdp=False, hf_deepspeed_config=SimpleNamespace(config=config),
                           deepspeed_plugin=plugin)  # fmt: skip


def _args_for(ckpt: Path) -> SimpleNamespace:
    if (ckpt / "latest").is_file():
        stage = 3 if any(ckpt.glob("global_step3/zero_pp_rank_*_model_states.pt")) else 2
        return _ds_args(stage)
    return SimpleNamespace(deepspeed=None, fsdp=True)


def _strategy_for(ckpt: Path) -> str:
    args = _args_for(ckpt)
    return f"zero{args.deepspeed['zero_optimization']['stage']}" if args.deepspeed else "fsdp_full_shard"


def _reads_weights(kind: str) -> bool:
    return kind in ("zero2 model states", "zero2 optimizer states", "zero3 model states", "dcp .metadata",
                    "pytorch_model_fsdp.bin")  # fmt: skip


def _load_without_hf_dist(planted: Path, fmt: str) -> None:
    if planted.name == ".metadata":
        with open(planted, "rb") as handle:
            pickle.load(handle)
    elif planted.suffix == ".distcp":
        import torch.distributed.checkpoint as dcp

        dcp.load({"state": torch.zeros(2), "param_groups": None}, checkpoint_id=str(planted.parent), no_dist=True)
    else:
        # the tar payload returns mkdir's None where torch expects a storage count: it ran, then torch fails
        with contextlib.suppress(TypeError) if fmt == "tar" else contextlib.nullcontext():
            torch.load(planted, weights_only=False)


@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_planted_payload_runs_when_loaded_without_hf_dist(kind, fmt, tmp_path, tiny_state):
    _, planted, marker = _build(kind, tmp_path, tiny_state, fmt)
    _load_without_hf_dist(planted, fmt)
    assert marker.is_dir()  # the payload is live: the tests below can fail


def _refusal(planted: Path, fmt: str) -> str:
    if planted.suffix == ".distcp":
        return rf"refusing to load a value stored in {planted}: .*posix\.mkdir"
    if planted.name == ".metadata":
        return rf"refusing to load {planted}: it names the global posix\.mkdir"
    return rf"refusing to load {planted}: .*{NAMED[fmt]}"


@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_every_entry_point_refuses_the_payload(kind, fmt, tmp_path, tiny_state, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # resuming on another world size: the reshard path is taken
    ckpt, planted, marker = _build(kind, tmp_path, tiny_state, fmt)
    run, refused = ckpt.parent, _refusal(planted, fmt)
    if planted.suffix != ".distcp":  # DCP's payloads are loaded by DCP alone, under the guard (below)
        with pytest.raises(UnsafePickleError, match=refused):
            check_loadable(ckpt)
    recipe_args = _args_for(ckpt)
    recipe_args.__dict__.update(resume_from_checkpoint="auto", output_dir=str(run), process_index=0)
    for entry in (
        lambda: auto_resume(run),
        lambda: auto_resume(run, strategy=_strategy_for(ckpt)),
        lambda: auto_resume(run, training_args=_args_for(ckpt)),
        lambda: prepare_resume(ckpt, 3, training_args=_args_for(ckpt)),
        lambda: resume_checkpoint(recipe_args),  # a recipe's --resume_from_checkpoint auto
    ):
        with pytest.raises(UnsafePickleError, match=str(planted.parent)):
            entry()
    if (ckpt / "latest").is_file():
        with pytest.raises(UnsafePickleError, match=refused):
            reshard(ckpt)
        with pytest.raises(UnsafePickleError, match=refused):
            reshard(ckpt, tmp_path / "copy")
        assert main(["reshard", str(ckpt)]) == 1
        assert f"refusing to load {planted}" in capsys.readouterr().err
        assert not (ckpt / "latest_universal").exists() and not (tmp_path / "copy").exists()
    # convert/verify read the weight files (the trainer's own files are not theirs to read)
    code = main(["convert", str(ckpt), str(tmp_path / "hf"), "--no-progress"])
    err = capsys.readouterr().err
    if _reads_weights(kind):
        assert code == 1 and f"{planted}" in err and (NAMED[fmt] in err or "posix.mkdir" in err), err
        assert len([line for line in err.splitlines() if "refusing" in line]) == 1
        assert main(["verify", str(ckpt), str(ckpt)]) == 1
        assert "refusing to load" in capsys.readouterr().err
    else:
        assert code == 0
    assert not marker.exists()


@pytest.fixture
def no_early_check(monkeypatch):
    """The early refusal (check_loadable) switched off everywhere: only the guarded loads stand."""
    for module in (loading, resume_checks, reshard_module):
        if hasattr(module, "check_loadable"):
            monkeypatch.setattr(module, "check_loadable", lambda *a, **k: [])
    monkeypatch.setattr(resume_checks, "gate_checkpoint", lambda *a, **k: None)
    monkeypatch.setattr(reshard_module, "gate_checkpoint", lambda *a, **k: None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_loads_are_refused_by_the_guard_alone(stage, fmt, tmp_path, tiny_state, no_early_check):
    """DeepSpeed's ds_to_universal unpickles every file with weights_only=False; under the guard each load is
    torch's weights_only load, which refuses the payload while parsing it, in every format. Every file of the tag
    is planted: whichever DeepSpeed opens first must be refused."""
    pytest.importorskip("deepspeed")
    ckpt = _zero_run(tmp_path, tiny_state, stage)
    marker = tmp_path / "PAYLOAD_RAN"
    for file in sorted((ckpt / "global_step3").glob("*.pt")):
        plant(file, marker, fmt)
    refused = rf"refusing to load .*global_step3/[^/]*\.pt: .*{NAMED[fmt]}"
    with pytest.raises(UnsafePickleError, match=refused):
        prepare_resume(ckpt, 3, training_args=_ds_args(stage))
    with pytest.raises(UnsafePickleError, match=refused):
        reshard(ckpt, tmp_path / "copy")
    assert not marker.exists() and not (ckpt / "latest_universal").exists() and not (tmp_path / "copy").exists()


@pytest.mark.parametrize("kind", ["dcp .metadata", "dcp non-tensor value in .distcp"])
def test_dcp_loads_are_refused_by_the_guard_alone(kind, tmp_path, tiny_state):
    """accelerate's FSDP loads and hf_dist's TP optimizer call ``dcp.load`` with a plain FileSystemReader: under the
    guard its metadata read and its byte payloads are refused."""
    import torch.distributed.checkpoint as dcp

    ckpt, planted, marker = _build(kind, tmp_path, tiny_state)
    folder = planted.parent
    target = {"state": torch.zeros(2), "param_groups": None} if planted.suffix == ".distcp" else {}
    with pytest.raises(UnsafePickleError, match=_refusal(planted, "zip")), guarded_loads(ckpt):
        dcp.load(target, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    assert not marker.exists()


def test_trust_pickles_lets_deepspeed_run_the_payload(tmp_path, tiny_state):
    """Control through a real library loader: with trust_pickles DeepSpeed's own weights_only=False load runs."""
    pytest.importorskip("deepspeed")
    ckpt, _, marker = _build("zero2 model states", tmp_path, tiny_state)
    with pytest.raises(UnsafePickleError):
        reshard(ckpt)
    assert not marker.exists()
    with contextlib.suppress(RuntimeError):  # the fake checkpoint need not convert; loading it is what matters
        reshard(ckpt, trust_pickles=True)
    assert marker.is_dir()


# ---------------------------------------------------------------- path escapes


def _match_marker(ckpt: Path) -> None:
    import json

    from hf_dist.checkpoint.formats.names import MANIFEST_NAME
    from hf_dist.checkpoint.lifecycle.manifest import hash_file

    marker = json.loads((ckpt / MANIFEST_NAME).read_text())
    for rel, entry in marker["files"].items():
        entry.update(size=(ckpt / rel).stat().st_size, sha256=hash_file(ckpt / rel))  # through the links
    (ckpt / MANIFEST_NAME).write_text(json.dumps(marker))


@pytest.mark.parametrize("how", ESCAPES)
def test_a_path_leaving_the_checkpoint_is_refused_everywhere(how, tmp_path, tiny_state, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    ckpt = _zero_run(tmp_path, tiny_state, 2)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    seal(ckpt, world_size=2, step=3)
    refused = escape(ckpt, how, outside)
    _match_marker(ckpt)  # as an attacker would: the marker proves nothing about where files live
    expected = rf"refusing to read {refused}"
    for entry in (
        lambda: check_loadable(ckpt),
        lambda: auto_resume(ckpt.parent),
        lambda: auto_resume(ckpt.parent, training_args=_ds_args(2)),
        lambda: prepare_resume(ckpt, 3, training_args=_ds_args(2)),
        lambda: reshard(ckpt),
        lambda: reshard(ckpt, tmp_path / "copy"),
    ):
        with pytest.raises((PathEscapeError, RuntimeError), match=expected):
            entry()
    for argv in (["convert", str(ckpt), str(tmp_path / "hf"), "--no-progress"], ["verify", str(ckpt), str(ckpt)]):
        assert main(argv) == 1
        assert f"refusing to read {refused}" in capsys.readouterr().err
    assert not (outside / "PAYLOAD_RAN").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("how", ESCAPES)
def test_the_guard_alone_keeps_deepspeed_inside(how, tmp_path, tiny_state, no_early_check):
    """With the early checks off, DeepSpeed's converter still reads nothing outside the checkpoint: its loads are
    confined by the guard (and ``latest`` by the layout reader)."""
    pytest.importorskip("deepspeed")
    ckpt = _zero_run(tmp_path, tiny_state, 2)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    escape(ckpt, how, outside)
    with pytest.raises(PathEscapeError, match="refusing to read"):
        reshard(ckpt, tmp_path / "copy")
    assert not (outside / "PAYLOAD_RAN").exists()


def test_dcp_metadata_naming_a_file_outside_is_refused(tmp_path, tiny_state):
    import torch.distributed.checkpoint as dcp

    ckpt = _dcp_run(tmp_path, tiny_state)
    folder = ckpt / "pytorch_model_fsdp_0"
    with open(folder / ".metadata", "rb") as handle:
        metadata = pickle.load(handle)
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    with open(folder / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    with pytest.raises(PathEscapeError, match="elsewhere.distcp"):
        check_loadable(ckpt)
    with pytest.raises(PathEscapeError, match="elsewhere.distcp"), guarded_loads(ckpt):
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--no-progress"]) == 1
