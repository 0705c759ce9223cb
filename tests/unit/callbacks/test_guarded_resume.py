"""A real Trainer resumed under ``attach``: every checkpoint load it makes is guarded (weights_only, paths confined)."""

from __future__ import annotations

import shutil

import pytest

from hf_dist.callbacks import attach
from hf_dist.checkpoint.safety.errors import UnsafePickleError
from hf_dist.checkpoint.safety.paths import PathEscapeError
from tests.unit.checkpoint.safety.payloads import FORMATS, plant


@pytest.fixture
def saved(make_trainer, tmp_path):
    """A plain Trainer's checkpoint-2 (weights, optimizer, scheduler, RNG state) and the folder it lives in."""
    trainer = make_trainer(max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file() and (ckpt / "rng_state.pth").is_file()
    return ckpt


def _resume(make_trainer, ckpt, *, guarded: bool = True):
    trainer = make_trainer(max_steps=3, callbacks=[])
    if guarded:
        attach(trainer, callbacks=[])
    trainer.train(resume_from_checkpoint=str(ckpt))
    return trainer


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_a_payload_in_a_trainer_resume_file_is_refused(name, fmt, saved, make_trainer, tmp_path):
    marker = tmp_path / "PAYLOAD_RAN"
    plant(saved / name, marker, fmt)
    with pytest.raises(UnsafePickleError, match=rf"^refusing to load {saved / name}: "):
        _resume(make_trainer, saved)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["optimizer.pt", "model.safetensors"])
def test_a_resume_file_linked_from_outside_is_refused(name, saved, make_trainer, tmp_path):
    """Only the guard can refuse this: the Trainer opens whatever the link leads to. Control: without attach the
    linked file is read."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(saved / name, outside / name)
    (saved / name).symlink_to(outside / name)
    _resume(make_trainer, saved, guarded=False)  # the link is followed: the test can fail
    with pytest.raises(PathEscapeError, match=rf"refusing to read {saved / name}: it resolves to .*elsewhere"):
        _resume(make_trainer, saved)


def test_a_clean_resume_under_attach_trains_on(saved, make_trainer):
    trainer = _resume(make_trainer, saved)
    assert trainer.state.global_step == 3


def test_the_best_model_load_is_guarded(tmp_path):
    """load_best_model_at_end loads from the best checkpoint: a link planted there after its save (same bytes, so its
    manifest still matches) is refused."""
    from transformers import TrainerCallback

    outside = tmp_path / "elsewhere"

    class LinkOutAfterLastSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == args.max_steps:
                best = f"{state.best_model_checkpoint}/model.safetensors"
                outside.mkdir(exist_ok=True)
                shutil.copy(best, outside / "model.safetensors")
                shutil.move(best, f"{best}.moved")
                (tmp_path / "link").symlink_to(outside / "model.safetensors")
                shutil.move(tmp_path / "link", best)

    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from hf_dist.testing import TokenDataset, tiny_llama_config

    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, save_strategy="steps",
        save_steps=1, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True, metric_for_best_model="loss",
        report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=LlamaForCausalLM(tiny_llama_config()), args=args, train_dataset=TokenDataset(32),
                      eval_dataset=TokenDataset(4), callbacks=[LinkOutAfterLastSave()])  # fmt: skip
    from hf_dist.callbacks.resume import CompleteCheckpointCallback

    attach(trainer, callbacks=[CompleteCheckpointCallback()])  # a manifest per checkpoint: the best one is eligible
    with pytest.raises(PathEscapeError, match="model.safetensors.*resolves to .*elsewhere"):
        trainer.train()
