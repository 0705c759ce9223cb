"""hf_dist.checkpoint.lifecycle.reshard on synthetic checkpoint folders (file layout only; real runs are in tests/distributed)."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_dist.checkpoint.lifecycle.reshard import (
    inspect_checkpoint,
    prepare_resume,
    to_universal,
    untie_optimizer_steps,
)
from hf_dist.cli.main import main
from hf_dist.planning.layout import CheckpointFamily


def make_deepspeed(path: Path, world: int, stage: int = 2, tag: str = "global_step10", tp: int = 1) -> Path:
    """File names only (``world`` data-parallel ranks; ``tp`` > 1: DeepSpeed AutoTP's mp_rank_0M files)."""
    folder = path / tag
    folder.mkdir(parents=True)
    (path / "latest").write_text(tag)
    for mp in range(tp):
        torch.save({}, folder / f"mp_rank_{mp:02d}_model_states.pt")
        for rank in range(world):
            torch.save({}, folder / f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt")
            if stage == 3:
                torch.save({}, folder / f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt")
    return path


def make_dcp(path: Path, world: int) -> Path:
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        (path / name).mkdir(parents=True)
        (path / name / ".metadata").write_bytes(pickle.dumps({}))
        for rank in range(world):
            (path / name / f"__{rank}_0.distcp").touch()
    return path


def ds_args(fsdp: bool = False, autotp: int = 0) -> SimpleNamespace:
    config: dict = {"zero_optimization": {"stage": 2}}
    if autotp:
        config["tensor_parallel"] = {"autotp_size": autotp}
    if fsdp:
        return SimpleNamespace(deepspeed=None, fsdp=True)
    plugin = SimpleNamespace(deepspeed_config=config, hf_ds_config=SimpleNamespace(config=config))
    return SimpleNamespace(
        deepspeed=config, fsdp=False, hf_deepspeed_config=SimpleNamespace(config=config), deepspeed_plugin=plugin
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_inspect_deepspeed(tmp_path, stage):
    layout = inspect_checkpoint(make_deepspeed(tmp_path, world=4, stage=stage))
    family = CheckpointFamily.ZERO3 if stage == 3 else CheckpointFamily.ZERO12
    assert (layout.format, layout.family, layout.world_size, layout.tag) == ("deepspeed", family, 4, "global_step10")
    assert layout.root == tmp_path and layout.path == tmp_path / "global_step10" and layout.universal_tag is None
    assert ("ZeRO-3" if stage == 3 else "ZeRO-1/2") in layout.describe() and "world size 4" in layout.describe()


def test_inspect_dcp_and_full(tmp_path):
    dcp = inspect_checkpoint(make_dcp(tmp_path / "a", world=3))
    assert (dcp.format, dcp.family, dcp.world_size, dcp.root) == ("dcp", CheckpointFamily.DCP, 3, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors").touch()
    assert inspect_checkpoint(tmp_path / "b").family is CheckpointFamily.FULL


def test_inspect_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        inspect_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a Trainer checkpoint: no supported checkpoint found"):
        inspect_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("global_step5")
    (tmp_path / "global_step5").mkdir()
    with pytest.raises(ValueError, match="no ZeRO optimizer files"):
        inspect_checkpoint(tmp_path)


def test_prepare_resume_same_world_or_dcp_needs_nothing(tmp_path):
    ds = make_deepspeed(tmp_path / "ds", world=2)
    args = ds_args()
    assert prepare_resume(ds, 2, training_args=args) == str(ds)
    assert "checkpoint" not in args.hf_deepspeed_config.config  # load_universal only when needed
    dcp = make_dcp(tmp_path / "dcp", world=2)
    assert prepare_resume(dcp, 5, training_args=ds_args(fsdp=True)) == str(dcp)


def test_prepare_resume_uses_existing_universal_and_enables_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # a non-zero rank only waits for rank 0's latest_universal
    ds = make_deepspeed(tmp_path, world=2)
    (tmp_path / "global_step10_universal").mkdir()
    (tmp_path / "latest_universal").write_text("global_step10_universal")
    args = ds_args()
    assert prepare_resume(ds, 3, training_args=args) == str(ds)
    assert args.hf_deepspeed_config.config["checkpoint"] == {"load_universal": True}
    assert args.deepspeed_plugin.deepspeed_config["checkpoint"] == {"load_universal": True}


def test_prepare_resume_errors(tmp_path, monkeypatch):
    ds = make_deepspeed(tmp_path / "ds", world=2)
    with pytest.raises(ValueError, match="pass training_args="):
        prepare_resume(ds, 3)
    with pytest.raises(RuntimeError, match="(?s)cannot resume a fsdp_full_shard run .*ZeRO-1/2.*hf-dist convert"):
        prepare_resume(ds, 2, training_args=ds_args(fsdp=True))
    with pytest.raises(RuntimeError, match="(?s)cannot resume a zero2 run .*FSDP distributed checkpoint"):
        prepare_resume(make_dcp(tmp_path / "dcp", 2), 2, training_args=ds_args())
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="waited 0s for rank 0"):
        prepare_resume(ds, 3, training_args=ds_args(), timeout_s=0.0)


def test_autotp_checkpoints_resume_only_on_their_own_layout(tmp_path):
    """AutoTP 2 x 2 data-parallel ranks: 4 ranks wrote it, and DeepSpeed loads it only there with autotp_size 2."""
    ds = make_deepspeed(tmp_path / "ds", world=2, tp=2)
    layout = inspect_checkpoint(ds)
    assert (layout.world_size, layout.tp_size, layout.missing_rank_files(4)) == (4, 2, [])
    assert prepare_resume(ds, 4, training_args=ds_args(autotp=2)) == str(ds)
    for world, autotp in ((4, 0), (2, 2), (4, 4)):
        with pytest.raises(ValueError, match=r"AutoTP size 2 on 4 ranks; this run has AutoTP size \d+ on \d+ ranks"):
            prepare_resume(ds, world, training_args=ds_args(autotp=autotp))
    plain = make_deepspeed(tmp_path / "plain", world=2)
    with pytest.raises(ValueError, match="AutoTP size 1 on 2 ranks; this run has AutoTP size 2"):
        prepare_resume(plain, 2, training_args=ds_args(autotp=2))
    with pytest.raises(ValueError, match="is a DeepSpeed AutoTP checkpoint; hf_dist reshards data-parallel"):
        to_universal(ds)


def test_untie_optimizer_steps():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=0.1)
    for p in params:
        p.grad = torch.ones(2)
    opt.step()
    shared = torch.tensor(4.0)
    for p in params:  # what DeepSpeed's ZeRO-3 universal loader does
        opt.state[p]["step"] = shared
    assert untie_optimizer_steps(SimpleNamespace(optimizer=opt)) == 2
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [5.0, 5.0, 5.0]


def test_cli_check(tmp_path, capsys):
    make_deepspeed(tmp_path, world=8, stage=3)
    assert main(["reshard", str(tmp_path), "--check", "16"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3" in out and "needs `hf-dist reshard" in out
    assert main(["reshard", str(tmp_path), "--check", "8"]) == 0
    assert "as is" in capsys.readouterr().out
    assert main(["reshard", str(tmp_path / "nope")]) == 1


def test_to_universal_never_leaves_latest_universal_naming_its_temporary_folder(tmp_path, monkeypatch):
    """DeepSpeed's converter writes ``latest_universal`` beside the folder it is given, naming it: given the temporary
    folder, the checkpoint's own would name it until hf_dist rewrote it (a reader in between, the manifest's or a
    waiting rank's, refuses a temporary name). Its file lands inside the folder and is dropped; the checkpoint's names
    the universal folder under its final name."""
    import os

    from deepspeed.checkpoint import ds_to_universal

    seen = []

    def deepspeed_main(args):  # what ds_to_universal.main writes (its last lines: os.path.split of output_folder)
        Path(args.output_folder, "zero").mkdir(parents=True)
        torch.save({}, Path(args.output_folder, "mp_rank_00_model_states.pt"))
        root, step_folder = os.path.split(args.output_folder)
        Path(root, "latest_universal").write_text(step_folder)
        seen.append(Path(root, "latest_universal"))

    monkeypatch.setattr(ds_to_universal, "main", deepspeed_main)
    ckpt = make_deepspeed(tmp_path / "checkpoint-10", world=2)
    universal = to_universal(ckpt)
    assert universal == ckpt / "global_step10_universal" and universal.is_dir()
    assert (ckpt / "latest_universal").read_text() == "global_step10_universal"
    assert seen and not seen[0].exists()  # DeepSpeed's own file, inside the temporary folder, is gone
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name]
