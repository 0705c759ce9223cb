"""The one Trainer extension (hf_dist.callbacks.extension): a class mixed in before the Trainer's own, so a user's
subclass keeps its methods, nothing is patched on the instance, and nothing stays replaced after training."""

from __future__ import annotations

import pytest
import torch
import transformers.trainer as trainer_module
from transformers import Trainer, TrainerCallback

from hf_dist.callbacks import attach
from hf_dist.callbacks.extension import EXTENDED, TrainerExtension, extend, extended_class
from hf_dist.callbacks.phases import CLOCK, Phase
from hf_dist.checkpoint.lifecycle.manifest import is_complete
from hf_dist.checkpoint.safety import loading


class UsersTrainer(Trainer):
    """A user's (or TRL's) subclass overriding two of the methods hf_dist extends."""

    calls: list[str] = []

    def evaluate(self, *args, **kwargs):
        self.calls.append("evaluate")
        return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        self.calls.append(f"save {self.state.global_step}")
        return super()._save_checkpoint(model, trial)


class SeesTheLoads(TrainerCallback):
    """Records, at train begin, whether the Trainer's DeepSpeed resume is hf_dist's guarded one."""

    def __init__(self) -> None:
        self.guarded: list[bool] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.guarded.append(getattr(trainer_module.deepspeed_load_checkpoint, "_hf_dist_guarded", False))


def _users_trainer(make_trainer, callbacks=(), **args):
    trainer = make_trainer(callbacks, **args)
    trainer.__class__ = UsersTrainer  # make_trainer builds a Trainer; the user's class adds methods only
    UsersTrainer.calls = []
    return trainer


def test_a_users_subclass_keeps_its_methods_and_hf_dist_runs_around_them(make_trainer, tmp_path):
    sees = SeesTheLoads()
    trainer = _users_trainer(make_trainer, [sees], max_steps=2, save_strategy="steps", save_steps=2)
    original_load, original_torch_load = trainer_module.deepspeed_load_checkpoint, torch.load
    attach(trainer, plan=False)
    assert type(trainer).__mro__[1:3] == (TrainerExtension, UsersTrainer) and type(trainer).__name__ == "UsersTrainer"
    assert not set(EXTENDED) & set(vars(trainer))  # nothing patched on the instance
    entered = CLOCK.entered
    trainer.train()
    trainer.evaluate(eval_dataset=trainer.train_dataset)
    assert UsersTrainer.calls == ["save 2", "evaluate"]  # the user's own methods ran, once each
    assert is_complete(tmp_path / "out" / "checkpoint-2")  # hf_dist's save bracket ran around the user's save
    assert CLOCK.entered >= entered + 2 and Phase.EVALUATE in CLOCK.longest
    assert sees.guarded == [True]  # guarded while train() ran ...
    assert trainer_module.deepspeed_load_checkpoint is original_load  # ... and put back after
    assert torch.load is original_torch_load and loading.active_root() is None


def test_the_deepspeed_load_is_put_back_when_training_fails(make_trainer):
    class Fails(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            raise RuntimeError("the user's callback failed")

    trainer = make_trainer([Fails()], max_steps=1)
    original = trainer_module.deepspeed_load_checkpoint
    attach(trainer, plan=False)
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        trainer.train()
    assert trainer_module.deepspeed_load_checkpoint is original


def test_a_resume_through_a_users_subclass_is_still_guarded(make_trainer, tmp_path):
    """The user's subclass overrides nothing of the loads, and the extension still guards them: a checkpoint
    changed after its manifest is refused by the resume."""
    from hf_dist.checkpoint.safety.errors import CorruptCheckpointError

    first = _users_trainer(make_trainer, max_steps=2, save_strategy="steps", save_steps=2)
    attach(first, plan=False)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    (checkpoint / "rng_state.pth").write_bytes(b"changed after the manifest")
    second = _users_trainer(make_trainer, max_steps=4, save_strategy="steps", save_steps=2)
    attach(second, plan=False)
    with pytest.raises(CorruptCheckpointError, match="rng_state.pth"):
        second.train(resume_from_checkpoint=str(checkpoint))


def test_a_trainer_class_without_a_method_hf_dist_extends_is_refused_by_name():
    class Old:
        def train(self):
            return None

    with pytest.raises(RuntimeError, match=r"cannot extend .*Old: it has no get_batch_samples, .*installed: \S+"):
        extended_class(Old)


def test_extending_twice_or_nothing_changes_nothing(make_trainer):
    trainer = make_trainer()
    extend(trainer)
    once = type(trainer)
    assert extend(extend(trainer)) is trainer and type(trainer) is once and extend(None) is None
