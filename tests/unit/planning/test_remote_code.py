"""No code from a model folder runs unless the user says so (issue 30): the Python entry points that read a config.

Each attacker's folder (:mod:`tests.unit.planning.remote_fakes`) names its own Python files in ``auto_map``; their
import leaves a marker folder. Without ``trust_remote_code`` the marker never appears and the refusal is one line
naming the file, the ``auto_map`` entry and the flag; with it the marker appears (the payload is live, so these
tests can fail) and the folder's model is planned.
"""

from __future__ import annotations

import inspect
import json
import logging
import re

import pytest

import hf_dist
from hf_dist.planning import model_source, modelinfo
from hf_dist.planning.remote_code import RemoteCodeError
from tests.unit.planning.remote_fakes import LLAMA, REFUSED, evil_config, plant, refusal_pattern

HARDWARE = {"gpus": 1, "gpu_memory_gib": 80}


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "MARKER"


def _entry_points(folder):
    """Every Python entry point that reads a model folder: name -> a call on ``folder`` without the flag."""
    return {
        "hf_dist.plan": lambda: hf_dist.plan(str(folder), **HARDWARE),
        "hf_dist.auto_args": lambda: hf_dist.auto_args(str(folder), **HARDWARE),
        "hf_dist.estimate_memory": lambda: hf_dist.estimate_memory(str(folder), "ddp", 1),
        "hf_dist.model_spec": lambda: hf_dist.model_spec(str(folder)),
        "hf_dist.model_spec(config.json)": lambda: hf_dist.model_spec(str(folder / "config.json")),
        "hf_dist.fsdp_wrap_classes": lambda: hf_dist.fsdp_wrap_classes(str(folder)),
        "resolve_config + meta_model": lambda: model_source.meta_model(model_source.resolve_config(str(folder))),
    }


ENTRY_POINTS = list(_entry_points(None))


@pytest.mark.parametrize("variant", REFUSED)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_without_the_flag_nothing_is_imported_and_one_line_says_why(tmp_path, marker, variant, entry):
    folder = plant(tmp_path / "model", variant, marker)
    with pytest.raises(RemoteCodeError) as caught:
        _entry_points(folder)[entry]()
    assert not marker.exists(), f"{entry}: the folder's code ran"
    message = str(caught.value)
    assert "\n" not in message and isinstance(caught.value, ValueError)
    if entry.endswith("(config.json)") and variant == "t5":  # a config.json read as data names its folder too
        assert "modeling_evil.py" in message and "--trust-remote-code" in message
    else:
        assert re.match(refusal_pattern(folder, variant), message), message


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_registered_causal_lm_is_planned_from_transformers_own_class(tmp_path, marker, entry, caplog):
    folder = plant(tmp_path / "model", "llama", marker)
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        result = _entry_points(folder)[entry]()
    assert not marker.exists(), f"{entry}: the folder's code ran"
    if entry == "resolve_config + meta_model":
        assert type(result).__name__ == "LlamaForCausalLM"
    if entry == "hf_dist.model_spec":
        plain = tmp_path / "plain"
        plain.mkdir()
        (plain / "config.json").write_text(json.dumps(LLAMA))
        assert result.num_params == hf_dist.model_spec(str(plain)).num_params


def test_the_ignored_auto_map_entry_is_said_once(tmp_path, marker, caplog):
    folder = plant(tmp_path / "model", "llama", marker)
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        hf_dist.plan(str(folder), **HARDWARE)
        hf_dist.plan(str(folder), **HARDWARE)
    said = [r.getMessage() for r in caplog.records if "auto_map" in r.getMessage()]
    assert len(said) == 1 and "transformers' own llama class" in said[0] and "--trust-remote-code" in said[0], said


@pytest.mark.parametrize("variant", ("unknown", "llama"))
def test_with_the_flag_the_payload_runs_and_the_folder_model_is_planned(tmp_path, marker, variant):
    """The control: the same folders, trusted, import their code (the marker appears) and plan its model."""
    folder = plant(tmp_path / "model", variant, marker)
    result = hf_dist.plan(str(folder), trust_remote_code=True, **HARDWARE)
    assert marker.exists(), "the payload did not run: the refusal tests above would pass for the wrong reason"
    assert result.model.num_params > 0 and result.strategy == "ddp"


def test_with_the_flag_t5s_payload_runs_too(tmp_path, marker):
    folder = plant(tmp_path / "model", "t5", marker)
    with pytest.raises(Exception):  # noqa: B017, PT011  (its class is no T5: whatever it raises, it ran)
        hf_dist.model_spec(str(folder), trust_remote_code=True)
    assert marker.exists()


def test_auto_args_and_estimate_memory_take_the_flag(tmp_path, marker):
    folder = plant(tmp_path / "model", "unknown", marker)
    estimate = hf_dist.estimate_memory(str(folder), "ddp", 1, trust_remote_code=True)
    assert marker.exists() and estimate.total > 0
    kwargs = hf_dist.auto_args(str(folder), trust_remote_code=True, **HARDWARE)
    assert kwargs["per_device_train_batch_size"] >= 1


def test_a_config_object_or_dict_naming_code_is_refused_too(tmp_path, marker):
    folder = plant(tmp_path / "model", "t5", marker)
    config = model_source.load_config(str(folder))  # a T5Config: transformers' own class, nothing imported
    assert not marker.exists() and type(config).__name__ == "T5Config"
    with pytest.raises(RemoteCodeError, match=r"modeling_evil\.py.*--trust-remote-code"):
        hf_dist.plan(config, **HARDWARE)
    with pytest.raises(RemoteCodeError, match=r"modeling_evil\.py beside the config.*--trust-remote-code"):
        hf_dist.model_spec(evil_config("t5"))
    assert not marker.exists()


@pytest.mark.parametrize("value", (None, "yes", 1))
def test_the_flag_is_true_or_false_never_none(tmp_path, marker, value):
    """None would let transformers prompt (resolve_trust_remote_code); hf_dist never passes it on."""
    folder = plant(tmp_path / "model", "llama", marker)
    with pytest.raises(ValueError, match=rf"trust_remote_code must be True or False, got {value!r}"):
        hf_dist.model_spec(str(folder), trust_remote_code=value)
    assert not marker.exists()


def test_meta_model_never_derives_the_permission_from_the_config():
    for function in (model_source.meta_model, modelinfo.model_spec, model_source.load_config, hf_dist.PlanRequest,
                     hf_dist.estimate_memory, hf_dist.trace_memory, hf_dist.convert, hf_dist.verify):  # fmt: skip
        assert inspect.signature(function).parameters["trust_remote_code"].default is False, function.__name__


def test_transformers_itself_imports_only_when_asked(tmp_path, marker):
    """What the guarantee rests on (transformers 5.x ``resolve_trust_remote_code``): an explicit False never imports
    (it raises where only the folder's code could build the config); True does."""
    from transformers import AutoConfig

    folder = plant(tmp_path / "model", "unknown", marker)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    assert not marker.exists()
    AutoConfig.from_pretrained(str(folder), trust_remote_code=True)
    assert marker.exists()
