"""Every ``Trainer`` method and ``transformers`` function hf_dist wraps or finds by name, with the parameters its
wrapper relies on. A transformers release that renames one, or changes the parameters hf_dist passes on, fails here
naming the method, what changed and the installed version, instead of somewhere deep in a resume (issue 40)."""

from __future__ import annotations

import inspect

import pytest
import transformers

# name -> (the leading parameters (after self) the wrapper relies on, in order; who relies on them)
CONTRACT = {
    "Trainer._load_from_checkpoint": (("resume_from_checkpoint",), "safety/trainer_loads: the checkpoint comes first"),
    "Trainer._load_optimizer_and_scheduler": (("checkpoint",), "safety/trainer_loads: the checkpoint comes first"),
    "Trainer._load_scaler": (("checkpoint",), "safety/trainer_loads: the checkpoint comes first"),
    "Trainer._load_rng_state": (("checkpoint",), "safety/trainer_loads: the checkpoint comes first"),
    "Trainer._load_best_model": ((), "safety/trainer_loads: loads state.best_model_checkpoint; callbacks/phases"),
    "Trainer._load_callback_state": ((), "safety/trainer_loads: runs right after a resume read trainer_state.json"),
    "Trainer._save_checkpoint": (("model", "trial"), "callbacks/resume: brackets every save; callbacks/phases"),
    "Trainer._get_output_dir": (("trial",), "callbacks/resume: the folder a save writes"),
    "Trainer.evaluate": ((), "callbacks/phases: timed as a phase, its arguments passed on"),
    "Trainer.get_batch_samples": (
        ("epoch_iterator", "num_batches", "device"),
        "lifecycle/finished: returns ([], None) once a resumed run is at max_steps",
    ),
    "Trainer.train": (("resume_from_checkpoint",), "lifecycle/model_config: reads the checkpoint before training"),
    "Trainer._inner_training_loop": ((), "callbacks/phases and watchdog: the training loop's frame, found by name"),
    "trainer.deepspeed_load_checkpoint": (
        ("deepspeed_engine", "checkpoint_path"),
        "safety/trainer_loads: the Trainer's DeepSpeed resume, guarded",
    ),
}


def _wrapped_by_hf_dist() -> set[str]:
    """The Trainer methods hf_dist's one extension class overrides."""
    from hf_dist.callbacks.extension import EXTENDED

    return {f"Trainer.{name}" for name in EXTENDED}


def _resolve(name: str):
    owner, attribute = name.split(".")
    module = transformers.Trainer if owner == "Trainer" else transformers.trainer
    return getattr(module, attribute, None)


def test_every_method_hf_dist_lists_has_a_contract():
    assert _wrapped_by_hf_dist() - set(CONTRACT) == set(), "a wrapped Trainer method without an entry in CONTRACT"


@pytest.mark.parametrize("name", list(CONTRACT))
def test_the_installed_transformers_keeps_what_hf_dist_relies_on(name):
    leading, who = CONTRACT[name]
    found = _resolve(name)
    version = f"transformers {transformers.__version__}"
    assert callable(found), f"{name} is gone in {version}; hf_dist relies on it ({who})"
    params = [p for p in inspect.signature(found).parameters if p != "self"]
    assert tuple(params[: len(leading)]) == leading, (
        f"{name} takes {params} in {version}; hf_dist relies on {list(leading)} first ({who})"
    )


@pytest.mark.parametrize("name", sorted(_wrapped_by_hf_dist()))
def test_the_extension_takes_what_it_passes_on_under_the_trainers_names(name):
    """Each method of the extension names its leading parameters as the Trainer does, so a caller passing them by
    keyword reaches the Trainer's method unchanged."""
    from hf_dist.callbacks.extension import TrainerExtension

    leading, who = CONTRACT[name]
    params = [p for p in inspect.signature(getattr(TrainerExtension, name.split(".")[1])).parameters if p != "self"]
    assert tuple(params[: len(leading)]) == leading, f"TrainerExtension.{name} takes {params}; {who}"
