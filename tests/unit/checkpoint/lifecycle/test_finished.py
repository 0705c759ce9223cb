"""A finished run resumed: the Trainer trains one step past max_steps (transformers' loop); attach: no step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hf_dist.callbacks import attach
from hf_dist.checkpoint.lifecycle.finished import finished_at, finished_message


@pytest.fixture
def finished(make_trainer, tmp_path):
    """checkpoint-2 of a run of max_steps 2 (16 batches per epoch: 2 is not a whole number of epochs)."""
    make_trainer(max_steps=2, save_strategy="steps", save_steps=2).train()
    return tmp_path / "out" / "checkpoint-2"


def test_the_trainer_alone_trains_one_step_past_a_finished_run(finished, make_trainer, tmp_path):
    """The cause, kept visible: if transformers stops doing this, the guard below can go."""
    trainer = make_trainer(max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train(resume_from_checkpoint=str(finished))
    assert trainer.state.global_step == 3 and (tmp_path / "out" / "checkpoint-3").is_dir()


def test_attach_makes_the_resume_of_a_finished_run_train_nothing(finished, make_trainer, tmp_path, capsys):
    trainer = make_trainer(max_steps=2, save_strategy="steps", save_steps=1)
    attach(trainer, callbacks=[])
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train(resume_from_checkpoint=str(finished))
    assert trainer.state.global_step == 2 and not (tmp_path / "out" / "checkpoint-3").exists()
    out = capsys.readouterr().out
    assert out.count("[hf_dist] nothing to train") == 1, out
    assert "the resumed state is at step 2 and max_steps is 2, so this run is finished" in out
    # the checkpoint's weights were loaded (the model holds the trained run, ready to save or evaluate)
    assert any((v != weights[k]).any() for k, v in trainer.model.state_dict().items())


def test_attach_lets_a_run_with_steps_left_train_on(finished, make_trainer):
    trainer = make_trainer(max_steps=3)
    attach(trainer, callbacks=[])
    trainer.train(resume_from_checkpoint=str(finished))
    assert trainer.state.global_step == 3


def test_finished_at_reads_the_checkpoint_and_the_runs_last_step(tmp_path):
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "max_steps": 4, "num_train_epochs": 1}))
    steps = SimpleNamespace(max_steps=4, num_train_epochs=3.0)
    assert finished_at(ckpt, steps) == (4, 4)
    assert finished_at(ckpt, SimpleNamespace(max_steps=3, num_train_epochs=3.0)) == (4, 3)  # past a lowered max
    assert finished_at(ckpt, SimpleNamespace(max_steps=8, num_train_epochs=3.0)) is None  # steps left
    # epochs: finished when the checkpoint's run counted the same epochs and reached its max_steps
    assert finished_at(ckpt, SimpleNamespace(max_steps=-1, num_train_epochs=1.0)) == (4, 4)
    assert finished_at(ckpt, SimpleNamespace(max_steps=-1, num_train_epochs=2.0)) is None
    assert finished_at(None, steps) is None and finished_at(tmp_path / "missing", steps) is None
    assert finished_message(4, 4, ckpt).startswith("[hf_dist] nothing to train: checkpoint-4 is at step 4 and")
