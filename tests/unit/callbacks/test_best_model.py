"""``best_model_checkpoint`` is a path read from a resumed ``trainer_state.json``: under ``attach`` the best model is
loaded only from a ``checkpoint-N`` of this run's ``output_dir`` whose manifest matches; anything else is dropped
with one warning and the final model is the one trained (issue 38, finding 4)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from hf_dist.callbacks import attach
from hf_dist.callbacks.resume import CompleteCheckpointCallback
from hf_dist.checkpoint.lifecycle.manifest import write_manifest


def _trainer(make_trainer, max_steps):
    from hf_dist.testing import TokenDataset

    return make_trainer(
        max_steps=max_steps, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
        load_best_model_at_end=True, metric_for_best_model="loss", eval_dataset=TokenDataset(4),
    )  # fmt: skip


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _trojan(folder):
    """Make ``folder``'s model.safetensors weights all 0.25 (recognisable), and its manifest match again."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    save_file({k: torch.full_like(v, 0.25) for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    write_manifest(folder, hashed={}, world_size=1, step=1)


@pytest.fixture
def run(make_trainer, tmp_path):
    """A first run (steps 1-2, a manifest per checkpoint) to resume from checkpoint-2."""
    trainer = _trainer(make_trainer, 2)
    attach(trainer, callbacks=[CompleteCheckpointCallback()])
    trainer.train()
    out = tmp_path / "out"
    assert (out / "checkpoint-2" / "hf_dist_complete.json").is_file()
    return out


def _plant_best(checkpoint, best):
    """The attacker's trainer_state.json: a best checkpoint of their choosing and a best metric never beaten; the
    manifest rewritten to match (a manifest is no signature). No best_global_step: the Trainer would otherwise
    point best_model_checkpoint at its own checkpoint-<best_global_step> on the next save."""
    state_path = checkpoint / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["best_model_checkpoint"], state["best_metric"], state["best_global_step"] = str(best), -1e9, None
    state_path.write_text(json.dumps(state))
    write_manifest(checkpoint, hashed={}, world_size=1, step=2)


def _outside(run, tmp_path):
    outside = tmp_path / "elsewhere" / "checkpoint-1"
    shutil.copytree(run / "checkpoint-1", outside)
    _trojan(outside)
    return outside


def _linked(run, tmp_path):
    link = run / "checkpoint-9"
    link.symlink_to(_outside(run, tmp_path), target_is_directory=True)
    return link


def _changed_after_manifest(run, tmp_path):
    from safetensors.torch import load_file, save_file

    best = run / "checkpoint-1"
    tensors = load_file(best / "model.safetensors")
    save_file({k: torch.full_like(v, 0.25) for k, v in tensors.items()}, best / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    return best


def _without_manifest(run, tmp_path):
    best = run / "checkpoint-1"
    _trojan(best)
    (best / "hf_dist_complete.json").unlink()
    return best


@pytest.mark.parametrize("planted", [_outside, _linked, _changed_after_manifest, _without_manifest])
def test_a_planted_best_model_checkpoint_is_dropped_and_the_trained_model_kept(
    planted, run, make_trainer, tmp_path, caplog
):
    best = planted(run, tmp_path)
    _plant_best(run / "checkpoint-2", best)

    control = _trainer(make_trainer, 3)  # without attach the Trainer loads the planted folder: the test can fail
    control.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert all(torch.all(v == 0.25) for v in _weights(control.model).values() if v.is_floating_point())
    shutil.rmtree(run / "checkpoint-3")

    trainer = _trainer(make_trainer, 3)
    attach(trainer, callbacks=[CompleteCheckpointCallback()])
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    warnings = [r.getMessage() for r in caplog.records if "best_model_checkpoint" in r.getMessage()]
    assert len(warnings) == 1 and str(best) in warnings[0] and "the final model is the one trained" in warnings[0]
    assert trainer.state.best_model_checkpoint is None
    from safetensors.torch import load_file

    trained = load_file(run / "checkpoint-3" / "model.safetensors")  # the weights of the last step trained
    final = _weights(trainer.model)
    assert trained and all(torch.equal(final[k], v) for k, v in trained.items())


def test_this_runs_best_checkpoint_with_a_matching_manifest_is_loaded(run, make_trainer, tmp_path, caplog):
    """The legitimate case: checkpoint-1 of this run, manifest matching, is loaded (the final model is its weights)."""
    _plant_best(run / "checkpoint-2", run / "checkpoint-1")
    trainer = _trainer(make_trainer, 3)
    attach(trainer, callbacks=[CompleteCheckpointCallback()])
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert not [r for r in caplog.records if "best_model_checkpoint" in r.getMessage()]
    from safetensors.torch import load_file

    best = load_file(run / "checkpoint-1" / "model.safetensors")
    final = _weights(trainer.model)
    assert all(torch.equal(final[k], v) for k, v in best.items())


def test_a_planted_best_checkpoint_does_not_make_the_trainer_delete_the_runs_checkpoints(run, make_trainer, tmp_path):
    """``save_total_limit=1``: at its end the Trainer deletes every checkpoint that is not the best one. A resumed state
    naming a folder outside made it delete all of this run's, the last one included (control); under ``attach`` the
    planted best is dropped as soon as the resume reads it, and the last checkpoint stays."""
    from hf_dist.testing import TokenDataset

    _plant_best(run / "checkpoint-2", _outside(run, tmp_path))
    shutil.copytree(run / "checkpoint-2", tmp_path / "pristine")

    def resumed(guarded):
        trainer = make_trainer(max_steps=3, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                               metric_for_best_model="loss", save_total_limit=1, eval_dataset=TokenDataset(4))  # fmt: skip
        if guarded:
            attach(trainer, callbacks=[CompleteCheckpointCallback()])
        trainer.train(resume_from_checkpoint=str(tmp_path / "pristine"))
        return trainer

    resumed(guarded=False)
    assert not list(run.glob("checkpoint-*"))  # the control: every checkpoint of the run deleted
    trainer = resumed(guarded=True)
    assert trainer.state.best_model_checkpoint != str(tmp_path / "elsewhere" / "checkpoint-1")
    assert (run / "checkpoint-3" / "model.safetensors").is_file()
    state = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())
    assert "elsewhere" not in str(state.get("best_model_checkpoint"))  # not carried into the next checkpoint


@pytest.mark.parametrize("planted", [_outside, _linked, _changed_after_manifest, _without_manifest])
def test_an_export_never_converts_a_planted_best_checkpoint(planted, run, tmp_path, caplog):
    """The exports' choice of checkpoint (``ExportCallback`` at train end, a recipe's ``final_checkpoint``: ZeRO-3
    converts it) does not trust ``best_model_checkpoint`` either, with or without ``attach``: the last step's is
    exported, with one warning; this run's own best with a matching manifest still is."""
    from types import SimpleNamespace

    from hf_dist.callbacks.export import ended_with
    from hf_dist.recipe_utils.export import final_checkpoint

    args = SimpleNamespace(output_dir=str(run), load_best_model_at_end=True)
    best = planted(run, tmp_path)
    trainer = SimpleNamespace(args=args, state=SimpleNamespace(global_step=2, best_model_checkpoint=str(best)))
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        assert ended_with(args, trainer.state) == final_checkpoint(trainer) == run / "checkpoint-2"
    warnings = [r.getMessage() for r in caplog.records if "not exporting best_model_checkpoint" in r.getMessage()]
    assert len(warnings) == 2 and str(best) in warnings[0]  # one per call


def test_an_export_of_this_runs_best_checkpoint_is_that_checkpoint(run):
    from types import SimpleNamespace

    from hf_dist.callbacks.export import ended_with

    args = SimpleNamespace(output_dir=str(run), load_best_model_at_end=True)
    assert ended_with(args, SimpleNamespace(global_step=2, best_model_checkpoint=str(run / "checkpoint-1"))) == (
        run / "checkpoint-1"
    )
    assert ended_with(args, SimpleNamespace(global_step=2, best_model_checkpoint=None)) == run / "checkpoint-2"
