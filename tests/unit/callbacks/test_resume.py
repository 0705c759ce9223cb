"""Complete-checkpoint markers, auto_resume, layout detection and the strategy-mismatch error."""

from __future__ import annotations

import errno
import json
import pickle
from pathlib import Path

import pytest
import torch

from hf_dist.callbacks.resume import CompleteCheckpointCallback
from hf_dist.checkpoint.formats.contents import read_contents
from hf_dist.checkpoint.formats.names import MANIFEST_NAME
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.manifest import incomplete_reasons, is_complete, write_manifest
from hf_dist.checkpoint.lifecycle.resume_checks import check_resume_compatible
from hf_dist.checkpoint.safety.loading import PICKLE_SUFFIXES
from tests.unit.checkpoint.fakes import seal


def fake_checkpoint(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """Files with the given bytes; pickle files hold those bytes ``torch.save``d (auto_resume loads them)."""
    folder = root / f"checkpoint-{step}"
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        if Path(rel).suffix in PICKLE_SUFFIXES:
            torch.save(data, folder / rel)
        elif Path(rel).name == ".metadata":  # DCP's metadata is a plain pickle
            (folder / rel).write_bytes(pickle.dumps(data))
        else:
            (folder / rel).write_bytes(data)
    return folder


DDP2 = {"model.safetensors": b"w" * 10, "optimizer.pt": b"o" * 7, "rng_state_0.pth": b"r", "rng_state_1.pth": b"r"}
ZERO3 = {
    "global_step4/zero_pp_rank_0_mp_rank_00_model_states.pt": b"m",
    "global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt": b"m",
    "global_step4/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": b"o",
    "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": b"o",
    "latest": b"global_step4",
    "trainer_state.json": b"{}",
}
ZERO2 = {
    "global_step4/mp_rank_00_model_states.pt": b"m",
    "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": b"o",
    "global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt": b"o",
}
FSDP = {
    "pytorch_model_fsdp_0/__0_0.distcp": b"m",
    "pytorch_model_fsdp_0/__1_0.distcp": b"m",
    "pytorch_model_fsdp_0/.metadata": b"x",
    "optimizer_0/__0_0.distcp": b"o",
    "optimizer_0/__1_0.distcp": b"o",
}


def test_manifest_lists_every_file_with_size_and_hash_and_detects_changes(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2, DDP2)
    assert incomplete_reasons(ckpt) == [f"no {MANIFEST_NAME} (the save did not finish on every rank)"]
    manifest = write_manifest(ckpt, hashed={}, world_size=2, strategy="ddp", step=2, run="r1", save="s1")
    assert (
        manifest["files"]["model.safetensors"]["size"] == 10 and len(manifest["files"]["optimizer.pt"]["sha256"]) == 64
    )
    assert json.loads((ckpt / MANIFEST_NAME).read_text())["layout"] == "full" and manifest["run"] == "r1"
    assert is_complete(ckpt)
    torch.save(b"O" * 7, ckpt / "optimizer.pt")  # same size, other content
    assert incomplete_reasons(ckpt) == ["optimizer.pt differs from the manifest (SHA-256; same size, other content)"]
    torch.save(b"o" * 7, ckpt / "optimizer.pt")
    assert is_complete(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"w" * 3)  # truncated
    assert incomplete_reasons(ckpt) == ["model.safetensors has 3 bytes, the manifest says 10"]
    (ckpt / "rng_state_1.pth").unlink()
    assert "rng_state_1.pth is missing" in incomplete_reasons(ckpt)
    (ckpt / MANIFEST_NAME).write_text("{not json")
    assert incomplete_reasons(ckpt)[0].startswith(f"unreadable {MANIFEST_NAME}")


@pytest.mark.parametrize(
    ("layout", "dropped"),
    [
        (DDP2, "rng_state_1.pth"),
        (ZERO3, "global_step4/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        (ZERO3, "global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt"),
        (FSDP, "optimizer_0/__1_0.distcp"),
    ],
)
def test_a_checkpoint_missing_a_ranks_files_gets_no_manifest(tmp_path, layout, dropped):
    files = dict(layout)
    del files[dropped]
    ckpt = fake_checkpoint(tmp_path, 4, files)
    assert read_contents(ckpt, strict=False).missing_rank_files(2)
    with pytest.raises(RuntimeError, match="not complete: missing .*rank 1"):
        seal(ckpt, world_size=2)
    assert not (ckpt / MANIFEST_NAME).exists()


def test_auto_resume_returns_newest_complete_and_skips_partial(tmp_path):
    assert auto_resume(tmp_path / "missing") is None
    assert auto_resume(tmp_path) is None
    for step in (2, 10):
        seal(fake_checkpoint(tmp_path, step, DDP2), world_size=2)
    fake_checkpoint(tmp_path, 12, DDP2)  # a save that never finished: no marker
    (tmp_path / "checkpoint-11-hf").mkdir()  # not a checkpoint name
    assert auto_resume(tmp_path) == str(tmp_path / "checkpoint-10")  # 10 > 2 numerically, 12 is partial
    (tmp_path / "checkpoint-10" / "optimizer.pt").unlink()
    assert auto_resume(tmp_path) == str(tmp_path / "checkpoint-2")


@pytest.mark.parametrize(
    ("files", "family", "world"), [(DDP2, "full", 2), (ZERO3, "zero3", 2), (ZERO2, "zero12", 2), (FSDP, "fsdp", 2)]
)
def test_layout_detection(tmp_path, files, family, world):
    layout = read_contents(fake_checkpoint(tmp_path, 1, files), strict=False)
    assert (layout.family.value, layout.world_size) == (family, world)


def test_resuming_zero3_checkpoint_into_fsdp_names_convert(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 4, ZERO3)
    seal(ckpt, world_size=2)
    with pytest.raises(RuntimeError, match=r"(?s)DeepSpeed ZeRO-3 shards.*FSDP.*hf-dist convert .*hf-dist reshard"):
        auto_resume(tmp_path, strategy="fsdp_full_shard")
    with pytest.raises(RuntimeError, match="hf-dist convert"):
        check_resume_compatible(ckpt, "zero2")
    check_resume_compatible(ckpt, "zero3", world_size=2)  # same layout, same world: fine
    with pytest.raises(RuntimeError, match=r"on 4 ranks: .*written by 2 ranks.*`hf-dist reshard .*checkpoint-4`"):
        check_resume_compatible(ckpt, "zero3", world_size=4)
    (ckpt / "latest_universal").write_text("global_step4_universal")  # what `hf-dist reshard` adds
    check_resume_compatible(ckpt, "zero3", world_size=4)
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        check_resume_compatible(ckpt, "zero4")


def test_full_and_fsdp_checkpoints_resume_on_another_world_size(tmp_path):
    check_resume_compatible(fake_checkpoint(tmp_path / "a", 4, DDP2), "ddp", world_size=3)  # replicated weights
    check_resume_compatible(fake_checkpoint(tmp_path / "b", 4, FSDP), "fsdp_full_shard", world_size=3)  # DCP reshards


def test_resume_check_uses_the_live_trainer(make_trainer, tmp_path):
    seal(fake_checkpoint(tmp_path, 4, FSDP), world_size=2)
    trainer = make_trainer()
    with pytest.raises(RuntimeError, match=r"(?s)cannot resume a ddp run .*FSDP distributed checkpoint"):
        auto_resume(tmp_path, strategy=trainer)


def test_manifest_write_is_atomic_when_the_disk_is_full(tmp_path, monkeypatch):
    ckpt = fake_checkpoint(tmp_path, 2, DDP2)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("hf_dist.atomic_io.os.fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        seal(ckpt, world_size=2)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(DDP2)  # no marker, no temporary file


def test_disk_full_during_save_keeps_previous_checkpoint_usable(make_trainer, tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = make_trainer([CompleteCheckpointCallback()], output_dir=str(out), save_strategy="steps", save_steps=2)
    original = trainer._save_optimizer_and_scheduler

    def fill_disk_at_step_4(output_dir):
        if trainer.state.global_step == 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(output_dir)

    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", fill_disk_at_step_4)
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    assert (out / "checkpoint-4" / "model.safetensors").exists()  # half-written
    assert auto_resume(out) == str(out / "checkpoint-2")
    # The previous complete checkpoint really resumes (space freed: the save works again).
    monkeypatch.setattr(trainer, "_save_optimizer_and_scheduler", original)
    trainer.train(resume_from_checkpoint=auto_resume(out))
    assert trainer.state.global_step == 4 and is_complete(out / "checkpoint-4")


def test_a_run_without_hf_dist_callbacks_resumes_from_the_trainers_own_files(make_trainer, tmp_path, caplog):
    """The README snippet without callbacks: no marker, yet the newest checkpoint is proven complete from
    trainer_state.json and the rank files, and the restart continues instead of starting over at step 0."""
    out = tmp_path / "plain"
    trainer = make_trainer(output_dir=str(out), save_strategy="steps", save_steps=2)
    trainer.train()
    assert not (out / "checkpoint-4" / MANIFEST_NAME).exists()
    with caplog.at_level("INFO", logger="hf_dist.checkpoint.lifecycle.auto_resume"):
        assert auto_resume(out) == str(out / "checkpoint-4")
    assert "proved complete from the files its strategy writes" in caplog.text
    from transformers import TrainerCallback

    class CountSteps(TrainerCallback):
        steps = 0

        def on_step_end(self, args, state, control, **kwargs):
            CountSteps.steps += 1

    again = make_trainer([CountSteps()], output_dir=str(out), save_strategy="steps", save_steps=2, max_steps=6)
    again.train(resume_from_checkpoint=auto_resume(out))
    assert again.state.global_step == 6 and CountSteps.steps == 2  # steps 5 and 6 only: it continued


def test_unmarked_checkpoints_name_the_real_cause_and_never_silently_start_over(tmp_path, monkeypatch):
    ckpt = fake_checkpoint(tmp_path, 4, {**DDP2, "trainer_state.json": b'{"global_step": 4}'})
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (ckpt / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 4)  # 4 of 8 bytes
    monkeypatch.setenv("WORLD_SIZE", "3")  # the live run has 3 ranks: rank 2's RNG state must be there
    with pytest.raises(RuntimeError, match=r"(?s)1 checkpoint\(s\) and none can be proven complete.*checkpoint-4: "
                       r"no hf_dist_complete.json and its files do not prove it complete: .*fresh_start=True") as caught:  # fmt: skip
        auto_resume(tmp_path)
    for reason in ("rng state of rank 2 is missing", "scheduler.pt is missing",
                   "model.safetensors is truncated: "):  # fmt: skip
        assert reason in str(caught.value)
    assert auto_resume(tmp_path, fresh_start=True) is None  # asked for explicitly
    (ckpt / "trainer_state.json").write_text('{"global_step": 3}')
    with pytest.raises(RuntimeError, match="trainer_state.json says global_step 3, the folder name 4"):
        auto_resume(tmp_path, world_size=2)


def test_callback_warns_when_rotation_can_delete_the_last_complete_checkpoint(make_trainer, caplog):
    trainer = make_trainer([CompleteCheckpointCallback()], max_steps=1, save_total_limit=1)
    trainer.train()
    assert "save_total_limit=1" in caplog.text


@pytest.mark.parametrize(
    ("marker", "reason"),
    [
        ({"files": ["model.safetensors"]}, '"files" must be an object'),
        ({"files": {"model.safetensors": {}}}, "the entry of model.safetensors has no integer size ({})"),
        ({"files": {"model.safetensors": {"size": "10"}}}, "no integer size ({'size': '10'})"),
        ({"files": {"model.safetensors": {"size": True}}}, "no integer size"),
        ({"files": {"../x": {"size": 1}}}, "points outside the checkpoint"),
        ({"files": {}, "world_size": 0}, '"world_size" must be a positive integer, got 0'),
        ([1, 2], "expected a JSON object, got list"),
    ],
)
def test_malformed_manifests_are_incomplete_with_a_reason(tmp_path, marker, reason):
    ckpt = fake_checkpoint(tmp_path, 2, DDP2)
    (ckpt / MANIFEST_NAME).write_text(json.dumps(marker))
    reasons = incomplete_reasons(ckpt)
    assert len(reasons) == 1 and reason in reasons[0] and reasons[0].startswith(f"malformed {MANIFEST_NAME}")
    with pytest.raises(RuntimeError, match="none can be proven complete"):
        auto_resume(tmp_path)


def test_manifest_without_files_does_not_hide_a_missing_rank(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2, ZERO3)
    (ckpt / "global_step4/zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    (ckpt / MANIFEST_NAME).write_text(json.dumps({"files": {}, "world_size": 2}))
    reasons = incomplete_reasons(ckpt)
    assert "DeepSpeed ZeRO-3 model shard of rank 1 is missing" in reasons
    assert any("not in the manifest (written after it" in r for r in reasons)


def test_auto_resume_refuses_a_checkpoint_folder_as_output_dir(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 2, DDP2)
    seal(ckpt, world_size=2)
    with pytest.raises(
        ValueError, match=rf"(?s)auto_resume got {ckpt}, which is a checkpoint folder itself.\n  Pass .*{tmp_path}"
    ):
        auto_resume(ckpt)
    assert auto_resume(tmp_path) == str(ckpt)


@pytest.mark.parametrize(
    ("layout", "args", "match"),
    [
        (ZERO3, {"deepspeed": {"zero_optimization": {"stage": 2}}}, "(?s)cannot resume a zero2 run .*ZeRO-3 shards"),
        (ZERO2, {"deepspeed": {"zero_optimization": {"stage": 3}}}, "(?s)cannot resume a zero3 run .*ZeRO-1/2 shards"),
        (
            DDP2,
            {"deepspeed": None, "fsdp": True},
            r"(?s)cannot resume a fsdp_full_shard run .*full weights \+ optimizer",
        ),
        (FSDP, {"deepspeed": None, "fsdp": False}, "(?s)cannot resume a ddp run .*FSDP distributed checkpoint"),
    ],
)
def test_auto_resume_checks_the_family_against_training_args(tmp_path, layout, args, match):
    from types import SimpleNamespace

    files = {**layout, "model.safetensors": b"w"} if layout is DDP2 else layout
    ckpt = fake_checkpoint(tmp_path, 4, files)
    seal(ckpt, world_size=2)
    with pytest.raises(RuntimeError, match=match):
        auto_resume(tmp_path, training_args=SimpleNamespace(**args), world_size=2)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"deepspeed": {"zero_optimization": {"stage": 1}}}, "zero1"),
        ({"deepspeed": {"zero_optimization": {"stage": 0}}}, None),
        ({"deepspeed": {"zero_optimization": {"stage": "auto"}}}, None),
        ({"deepspeed": None, "fsdp": "full_shard auto_wrap"}, "fsdp_full_shard"),
        ({"deepspeed": None, "fsdp": ["shard_grad_op", "auto_wrap"]}, "fsdp_shard_grad_op"),
        ({"deepspeed": None, "fsdp": "hybrid_shard"}, "hsdp"),
        ({"deepspeed": None, "fsdp": True}, "fsdp_full_shard"),
        ({"deepspeed": None, "fsdp": ""}, "ddp"),
    ],
)
def test_strategy_of_args_names_registry_strategies(args, expected):
    from types import SimpleNamespace

    from hf_dist.checkpoint.lifecycle.resume_checks import strategy_of_args

    assert strategy_of_args(SimpleNamespace(**args)) == expected


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "true"}, "fsdp_full_shard"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"}, "fsdp_shard_grad_op"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "zero3"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, None),
        ({}, "ddp"),
    ],
)
def test_strategy_of_args_reads_what_an_accelerate_yaml_chose(env, expected, monkeypatch):
    """Under ``accelerate launch --config_file fsdp.yaml`` the arguments name no strategy before the Trainer exists:
    the resume check must not take the FSDP run for DDP (a requeued HSDP job was refused so, issue 39)."""
    from types import SimpleNamespace

    from hf_dist.checkpoint.lifecycle.resume_checks import strategy_of_args

    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_RESHARD_AFTER_FORWARD",
                "ACCELERATE_DEEPSPEED_ZERO_STAGE", "FSDP_SHARDING_STRATEGY"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert strategy_of_args(SimpleNamespace(deepspeed=None, fsdp="")) == expected


def test_auto_resume_says_on_rank_0_where_it_resumes_or_why_it_starts_from_scratch(tmp_path, capsys, monkeypatch):
    """One line a user sees without logging set up: the checkpoint and its step, or why the run starts at step 0."""
    from types import SimpleNamespace

    def said() -> list[str]:
        return capsys.readouterr().out.splitlines()

    auto_resume(tmp_path / "missing")
    assert said() == [f"[hf_dist] {tmp_path / 'missing'} does not exist yet: starting from scratch"]
    auto_resume(tmp_path)
    assert said() == [f"[hf_dist] no checkpoint-N folder in {tmp_path}: starting from scratch"]
    seal(fake_checkpoint(tmp_path, 6, {**DDP2, "trainer_state.json": b'{"global_step": 6}'}), world_size=2)
    fake_checkpoint(tmp_path, 8, DDP2)  # never finished: skipped with a warning, not resumed
    assert auto_resume(tmp_path) == str(tmp_path / "checkpoint-6")
    assert said() == [f"[hf_dist] resuming from {tmp_path / 'checkpoint-6'} at step 6"]
    monkeypatch.setenv("RANK", "1")  # another rank of the launch: silent
    auto_resume(tmp_path)
    assert said() == []
    auto_resume(tmp_path, training_args=SimpleNamespace(process_index=0, world_size=2))  # its rank wins
    assert said() == [f"[hf_dist] resuming from {tmp_path / 'checkpoint-6'} at step 6"]
    monkeypatch.delenv("RANK")
    assert auto_resume(tmp_path, announce=False) == str(tmp_path / "checkpoint-6")  # the caller says it
    assert said() == []
    (tmp_path / "checkpoint-6" / "optimizer.pt").unlink()
    assert auto_resume(tmp_path, fresh_start=True) is None
    assert said() == [f"[hf_dist] none of the 2 checkpoint(s) in {tmp_path} can be proven complete and "
                      "fresh_start=True: starting from scratch"]  # fmt: skip
