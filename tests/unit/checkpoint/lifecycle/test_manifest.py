"""A checkpoint is complete only when it is exactly what one save of one run wrote (issue 31), under a real Trainer.

Each case reproduces what went wrong before the manifest: a stale marker surviving a new save, the Trainer deleting
or loading a checkpoint whose background write was pending, checkpoints missing files taken as complete, another
run's checkpoint resumed after a roll-back, ``--overwrite`` and ``config --force`` over a run's files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dist.callbacks import attach
from hf_dist.checkpoint.formats.checkpoint_folder import load_manifest, open_checkpoint
from hf_dist.checkpoint.formats.names import MANIFEST_NAME, RUN_JOURNAL, WRITING_NAME
from hf_dist.checkpoint.lifecycle import async_save
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.manifest import incomplete_reasons, is_complete
from hf_dist.checkpoint.lifecycle.proof import unproven_reasons
from hf_dist.checkpoint.safety.paths import PathEscapeError
from hf_dist.cli.main import main

SAVE = dict(save_strategy="steps", save_steps=2, save_total_limit=5)


class Killed(Exception):
    """Stands for kill -9: the process stops here, whatever it was writing."""


def _run(make_trainer, out: Path, *, async_save_: bool = False, resume: str | None = None, **overrides):
    trainer = make_trainer(**{**SAVE, "output_dir": str(out), **overrides})
    attach(trainer, async_save=async_save_)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _killed_during_save_at(trainer, step: int) -> None:
    """The Trainer's save of ``step`` dies after the weights, before the optimizer (a sync save killed between files)."""
    original = trainer._save_optimizer_and_scheduler

    def die(output_dir):
        if trainer.state.global_step == step:
            raise Killed(f"killed while writing checkpoint-{step}")
        original(output_dir)

    trainer._save_optimizer_and_scheduler = die


def test_a_new_save_removes_the_old_manifest_before_its_first_file(make_trainer, tmp_path):
    """Run 1 writes checkpoint-2 and -4; the user rolls back to checkpoint-2 and trains again; that run dies while
    rewriting checkpoint-4. checkpoint-4 now holds run 2's weights beside run 1's optimizer: never resumed."""
    out = tmp_path / "out"
    _run(make_trainer, out)
    first = load_manifest(out / "checkpoint-4").data
    trainer = make_trainer(**{**SAVE, "output_dir": str(out)})
    attach(trainer)
    _killed_during_save_at(trainer, 4)
    with pytest.raises(Killed):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    ckpt4 = out / "checkpoint-4"
    assert not (ckpt4 / MANIFEST_NAME).exists() and json.loads((ckpt4 / WRITING_NAME).read_text())["step"] == 4
    assert load_file(ckpt4 / "model.safetensors").keys() and first["run"] != json.loads(
        (out / RUN_JOURNAL).read_text())["run"]  # fmt: skip
    assert auto_resume(out) == str(out / "checkpoint-2")
    assert "a save was writing into this folder and did not finish" in unproven_reasons(ckpt4, 1)[0]


def test_a_marked_checkpoint_with_a_pending_write_note_is_refused(make_trainer, tmp_path):
    """A manifest beside a note of another save (an older hf_dist's async save, which kept the marker) is mixed."""
    out = tmp_path / "out"
    _run(make_trainer, out)
    (out / "checkpoint-4" / WRITING_NAME).write_text(json.dumps({"step": 4, "save": "another"}))
    assert any(
        "began writing into this folder after the manifest" in r for r in incomplete_reasons(out / "checkpoint-4")
    )
    assert auto_resume(out) == str(out / "checkpoint-2")


def test_a_checkpoint_whose_files_changed_is_refused_naming_the_file(make_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    _run(make_trainer, out)
    state = torch.load(out / "checkpoint-4" / "optimizer.pt", weights_only=True)
    state["param_groups"][0]["lr"] = 123.0
    torch.save(state, out / "checkpoint-4" / "optimizer.pt")  # same size, other content
    assert incomplete_reasons(out / "checkpoint-4") == [
        "optimizer.pt differs from the manifest (SHA-256; same size, other content)"
    ]
    assert auto_resume(out) == str(out / "checkpoint-2")
    assert main(["convert", str(out / "checkpoint-4"), str(tmp_path / "hf"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "does not match its hf_dist_complete.json: optimizer.pt differs" in err and not (tmp_path / "hf").exists()
    (out / "checkpoint-2" / "extra.bin").write_bytes(b"written later")
    assert "extra.bin not in the manifest" in incomplete_reasons(out / "checkpoint-2")[0]


def test_the_manifest_lists_every_file_with_its_hash(make_trainer, tmp_path):
    out = tmp_path / "out"
    trainer = _run(make_trainer, out)
    manifest = load_manifest(out / "checkpoint-2").data
    files = sorted(p.relative_to(out / "checkpoint-2").as_posix() for p in (out / "checkpoint-2").rglob("*")
                   if p.is_file() and p.name != MANIFEST_NAME)  # fmt: skip
    assert sorted(manifest["files"]) == files and all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    assert manifest["run"] == json.loads((out / RUN_JOURNAL).read_text())["run"] and manifest["step"] == 2
    assert trainer.state.global_step == 4 and is_complete(out / "checkpoint-4")


def test_unmarked_checkpoints_missing_a_file_are_skipped_with_the_reason(make_trainer, tmp_path):
    """A plain Trainer run (no hf_dist callbacks): a checkpoint without optimizer.pt would resume Adam from zero."""
    out = tmp_path / "plain"
    make_trainer(**{**SAVE, "output_dir": str(out)}).train()
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    assert auto_resume(out) == str(out / "checkpoint-2")
    assert "optimizer.pt is missing (Adam would restart from zero moments)" in unproven_reasons(
        out / "checkpoint-4", 1
    )
    (out / "checkpoint-2" / "scheduler.pt").unlink()
    with pytest.raises(RuntimeError, match=r"(?s)none can be proven complete.*scheduler\.pt is missing"):
        auto_resume(out)


def test_a_zero_checkpoint_without_its_tag_folder_is_skipped(tmp_path, tiny_state):
    from tests.unit.checkpoint.fakes import make_trainer_zero_checkpoint

    for step in (2, 4):
        make_trainer_zero_checkpoint(tmp_path, tiny_state, step)
    import shutil

    shutil.rmtree(tmp_path / "checkpoint-4" / "global_step4")
    assert "global_step4/ is missing or holds no optimizer partitions" in " ".join(
        unproven_reasons(tmp_path / "checkpoint-4", 2)
    )
    assert auto_resume(tmp_path, world_size=2) == str(tmp_path / "checkpoint-2")


def test_another_runs_checkpoint_in_the_same_folder_is_not_resumed(make_trainer, tmp_path, caplog):
    """Run 1 reached checkpoint-6; run 2 rolled back to checkpoint-2 and died before its first save. Resuming the
    folder must continue run 2 (from checkpoint-2), not jump to run 1's checkpoint-6."""
    out = tmp_path / "out"
    _run(make_trainer, out, max_steps=6)
    trainer = make_trainer(**{**SAVE, "output_dir": str(out), "max_steps": 6})
    attach(trainer)
    _killed_during_save_at(trainer, 4)
    with pytest.raises(Killed):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    with caplog.at_level("WARNING"):
        assert auto_resume(out) == str(out / "checkpoint-2")
    assert "checkpoint-6: written by run" in caplog.text and "starting from checkpoint-2 (step 2)" in caplog.text


def test_the_trainer_never_deletes_or_loads_a_checkpoint_whose_write_is_pending(make_trainer, tmp_path, monkeypatch):
    """async_save with save_total_limit=1 and the best model loaded at the end: the rotation and the best-model load
    wait for the background write (slowed here so it is always pending), so every checkpoint left is complete and the
    model ends with the best checkpoint's weights."""
    submit = async_save.BackgroundWriter._submit

    def slow(self, fn, *args, **kwargs):
        submit(self, time.sleep, 0.3)
        return submit(self, fn, *args, **kwargs)

    monkeypatch.setattr(async_save.BackgroundWriter, "_submit", slow)
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from hf_dist.testing import TokenDataset, tiny_llama_config

    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=2, save_strategy="steps",
        save_steps=1, save_total_limit=1, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
        metric_for_best_model="loss", report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=5e-3,
    )  # fmt: skip
    trainer = Trainer(model=LlamaForCausalLM(tiny_llama_config()), args=args, train_dataset=TokenDataset(32),
                      eval_dataset=TokenDataset(4))  # fmt: skip
    attach(trainer, async_save=True)
    trainer.train()
    left = sorted((tmp_path / "out").glob("checkpoint-*"))
    assert left and all(is_complete(c) for c in left), [incomplete_reasons(c) for c in left]
    best = Path(trainer.state.best_model_checkpoint)
    saved = load_file(best / "model.safetensors")
    live = trainer.model.state_dict()
    assert all(torch.equal(saved[k], live[k]) for k in saved)


def test_a_folder_removed_during_its_background_write_is_not_recreated(tmp_path):
    writer = async_save.BackgroundWriter()
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    gate = __import__("threading").Event()
    writer._submit(gate.wait)
    with writer.intercept():
        torch.save({"w": torch.ones(2)}, folder / "optimizer.pt")
    folder.rmdir()
    gate.set()
    error = writer.wait()
    writer.close()
    assert "was removed while its files were being written in the background; not recreating it" in error
    assert not folder.exists()


def test_config_force_never_writes_into_a_checkpoint(make_trainer, tmp_path, capsys):
    out = tmp_path / "out"
    _run(make_trainer, out)
    target = out / "checkpoint-4" / "trainer_state.json"
    before = target.read_bytes()
    assert main(["config", "--strategy", "ddp", "--out", str(target), "--force"]) == 1
    assert "is in (or is a file of) a training checkpoint or run folder" in capsys.readouterr().err
    assert target.read_bytes() == before and is_complete(out / "checkpoint-4")
    assert main(["config", "--strategy", "ddp", "--out", str(out / "checkpoint-4" / "ddp.yaml"), "--force"]) == 1


@pytest.mark.parametrize("plant", ["link out", "nested", "not json", "size-only, malformed"])
def test_one_parser_reads_the_manifest_and_a_bad_one_is_one_reason_wherever_it_is_read(tmp_path, plant):
    """The proof of a checkpoint without a manifest parsed the file itself and skipped the shape check (issue 38);
    now load_manifest is the one parser, run once when the checkpoint is opened: a manifest linked out of its folder,
    nested past the parser's depth, not JSON, or an older size-only marker of the wrong shape is one reason, both
    where a manifest is checked and where the proof reads the marker."""
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"version": 2, "files": {}}))
    if plant == "link out":
        (ckpt / MANIFEST_NAME).symlink_to(outside)
    elif plant == "size-only, malformed":
        (ckpt / MANIFEST_NAME).write_text(json.dumps({"version": 1, "files": {"model.safetensors": {"size": "10"}}}))
    else:
        (ckpt / MANIFEST_NAME).write_text("[" * 100_000 if plant == "nested" else "{not json")
    checkpoint = open_checkpoint(ckpt, strict=False)
    problem = checkpoint.manifest.problem
    want = "malformed" if plant.endswith("malformed") else "unreadable"
    assert problem.startswith(f"{want} {MANIFEST_NAME}: ") and checkpoint.manifest.data is None
    assert len(problem.splitlines()) == 1 and len(problem) < 400
    assert incomplete_reasons(ckpt) == incomplete_reasons(checkpoint) == [problem]
    if plant == "link out":  # the proof's confinement check of every file refuses the folder outright
        with pytest.raises(PathEscapeError, match="outside the checkpoint"):
            unproven_reasons(ckpt, 1)
    else:
        assert problem in unproven_reasons(ckpt, 1) and problem in unproven_reasons(checkpoint, 1)
