"""The loading gate: a payload planted in any pickle of a checkpoint never runs, whichever entry point reads it.

The payload makes a folder when unpickled by a loader that trusts the file (as DeepSpeed's
``weights_only=False`` and DCP's ``pickle.load`` do); each test asserts the folder does not exist afterwards.
A control test shows the planted files really execute when loaded without the gate.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.marker import write_marker
from hf_dist.checkpoint.lifecycle.reshard import prepare_resume, reshard
from hf_dist.checkpoint.safety.pickles import UnsafePickleError, check_pickles
from hf_dist.cli.main import main
from tests.unit.checkpoint.fakes import make_zero_checkpoint


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant_torch(path: Path, marker: Path) -> None:
    state = torch.load(path, weights_only=False)
    state = state if isinstance(state, dict) else {"value": state}
    state["hf_dist_test_payload"] = Payload(marker)
    torch.save(state, path)


def _plant_tar(path: Path, marker: Path) -> None:
    """torch's legacy tar format (``torch/serialization.py``, ``_legacy_load``): the magic member, then
    ``storages``, whose first pickle torch.load unpickles with no allowlist; ``tensors`` and ``pickle`` follow."""
    import io
    import tarfile

    members = {"N.N.N.N.N.": b"", "storages": pickle.dumps(Payload(marker), protocol=2),
               "tensors": pickle.dumps(0, protocol=2), "pickle": pickle.dumps({}, protocol=2)}  # fmt: skip
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _plant_dcp_value(folder: Path, marker: Path) -> None:
    """A DCP save with a non-tensor value, stored the way DCP stores an optimizer's param_groups: a torch.save
    archive inside the .distcp file, which dcp.load unpickles with weights_only=False."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state": torch.ones(2), "param_groups": Payload(marker)}, checkpoint_id=str(folder), no_dist=True)


def _trainer_files(ckpt: Path) -> None:
    for rank in range(2):
        torch.save({"python": None, "cpu": torch.zeros(4, dtype=torch.uint8)}, ckpt / f"rng_state_{rank}.pth")
    torch.save({"last_epoch": 3, "_step_count": 4}, ckpt / "scheduler.pt")
    torch.save({"learning_rate": 1e-4}, ckpt / "training_args.bin")
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
    "training_args.bin": ("zero2", "training_args.bin"),
    "rng_state_1.pth": ("dcp", "rng_state_1.pth"),
    "scheduler.pt": ("zero3", "scheduler.pt"),
}


# How the payload is stored in a file torch.load reads: torch.save's zip archive, or torch's legacy tar format
# (which torch.load still accepts and unpickles without looking; it carries no type name to report).
FORMATS = {"zip": "posix.mkdir", "tar": "legacy tar format"}
CASES = [(kind, "zip") for kind in sorted(KINDS)] + [
    (kind, "tar") for kind in sorted(KINDS) if not KINDS[kind][1].endswith((".metadata", ".distcp"))
]


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
        with open(planted, "rb") as handle:
            metadata = pickle.load(handle)
        metadata.planted = Payload(marker)
        with open(planted, "wb") as handle:
            pickle.dump(metadata, handle)
    elif planted.suffix == ".distcp":
        _plant_dcp_value(planted.parent, marker)
    elif fmt == "tar":
        _plant_tar(planted, marker)
    else:
        _plant_torch(planted, marker)
    # a valid, matching marker: authenticity is not what the marker proves, the gate must still refuse
    write_marker(ckpt, world_size=2 if layout.startswith("zero") else 1, step=3)
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


@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_planted_payload_runs_when_loaded_without_the_gate(kind, fmt, tmp_path, tiny_state):
    _, planted, marker = _build(kind, tmp_path, tiny_state, fmt)
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
    assert marker.is_dir()  # the payload is live: the tests below can fail


@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_every_entry_point_refuses_the_payload(kind, fmt, tmp_path, tiny_state, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # resuming on another world size: the reshard path is taken
    ckpt, planted, marker = _build(kind, tmp_path, tiny_state, fmt)
    run = ckpt.parent
    named = FORMATS[fmt]
    with pytest.raises(UnsafePickleError, match=rf"(?s)refusing to load {planted}:\n.*{named}"):
        check_pickles(ckpt)
    with pytest.raises(UnsafePickleError, match=str(planted)):
        auto_resume(run)
    with pytest.raises(UnsafePickleError, match=str(planted)):
        auto_resume(run, strategy=_strategy_for(ckpt))
    with pytest.raises(UnsafePickleError, match=str(planted)):
        auto_resume(run, training_args=_args_for(ckpt))
    with pytest.raises(UnsafePickleError, match=str(planted)):
        prepare_resume(ckpt, 3, training_args=_args_for(ckpt))
    if (ckpt / "latest").is_file():
        with pytest.raises(UnsafePickleError, match=str(planted)):
            reshard(ckpt)
        with pytest.raises(UnsafePickleError, match=str(planted)):
            reshard(ckpt, tmp_path / "copy")
        assert main(["reshard", str(ckpt)]) == 1
        assert f"refusing to load {planted}" in capsys.readouterr().err
        assert not (ckpt / "latest_universal").exists() and not (tmp_path / "copy").exists()
    # convert/verify read the weight files (the trainer's own files are not theirs to read)
    code = main(["convert", str(ckpt), str(tmp_path / "hf"), "--no-progress"])
    err = capsys.readouterr().err
    if _reads_weights(kind):
        assert code == 1 and f"{planted}" in err and named in err
        assert main(["verify", str(ckpt), str(ckpt)]) == 1
        assert named in capsys.readouterr().err
    else:
        assert code == 0
    assert not marker.exists()


def test_trust_pickles_skips_the_gate_and_deepspeed_then_runs_the_payload(tmp_path, tiny_state):
    """Control through a real library loader: DeepSpeed's ds_to_universal unpickles with weights_only=False."""
    pytest.importorskip("deepspeed")
    ckpt, _, marker = _build("zero2 model states", tmp_path, tiny_state)
    with pytest.raises(UnsafePickleError):
        reshard(ckpt)
    assert not marker.exists()
    with contextlib.suppress(RuntimeError):  # the fake checkpoint need not convert; loading it is what matters
        reshard(ckpt, trust_pickles=True)
    assert marker.is_dir()


def test_real_trainer_files_pass_the_gate(tmp_path):
    import random

    import numpy as np
    from transformers import TrainingArguments

    torch.save(TrainingArguments(output_dir=str(tmp_path), report_to="none"), tmp_path / "training_args.bin")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               tmp_path / "rng_state.pth")  # fmt: skip
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert len(check_pickles(tmp_path)) == 4


def test_polyglot_file_is_checked_as_torch_reads_it(tmp_path):
    """A pickle with a zip appended: zipfile sees an archive, torch.load reads the leading pickle."""
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(Payload(tmp_path / "RAN"), protocol=2) + (tmp_path / "ok.pt").read_bytes())
    with pytest.raises(UnsafePickleError, match="evil.pt"):
        check_pickles(evil)
    assert not (tmp_path / "RAN").exists()


def test_torchscript_archive_is_refused(tmp_path):
    """torch.load(weights_only=False) hands a TorchScript zip to torch.jit.load, which runs the module's code
    (its ``__setstate__``); no checkpoint is one, so the gate and safe_load refuse it by torch's own test."""
    from hf_dist.checkpoint.safety.pickles import safe_load

    path = tmp_path / "pytorch_model.bin"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with pytest.warns(UserWarning, match="TorchScript archive"):
        torch.load(path, weights_only=False)  # the path is live: torch dispatches to torch.jit.load
    with pytest.raises(UnsafePickleError, match=rf"refusing to load {path}:\n  it is a TorchScript archive"):
        check_pickles(tmp_path)
    with pytest.raises(UnsafePickleError, match="TorchScript archive"):
        safe_load(path)
