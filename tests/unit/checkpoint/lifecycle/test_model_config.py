"""A checkpoint knows its model: config.json written into FSDP2's saves, another model's checkpoint refused on resume."""

from __future__ import annotations

import json

import pytest

from hf_dist.callbacks import attach
from hf_dist.checkpoint.lifecycle.model_config import OtherModelError, check_same_model, write_model_config
from hf_dist.testing import tiny_llama_config


def _model(**changes):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    for key, value in changes.items():
        setattr(config, key, value)
    return LlamaForCausalLM(config)


def test_config_and_generation_config_are_written_once_and_load_back(tmp_path):
    from transformers import AutoConfig

    model = _model()
    assert write_model_config(tmp_path, model) == ["config.json", "generation_config.json"]
    assert AutoConfig.from_pretrained(tmp_path).to_dict()["hidden_size"] == model.config.hidden_size
    assert write_model_config(tmp_path, model) == []  # a save that wrote its own keeps it


def test_a_peft_model_writes_its_base_models_config(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj"]))
    write_model_config(tmp_path, model)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


def test_another_architecture_is_refused_naming_both(tmp_path):
    write_model_config(tmp_path, _model())
    check_same_model(tmp_path, _model())  # the same model: no refusal
    other = _model(num_hidden_layers=3)
    with pytest.raises(
        OtherModelError, match=r"num_hidden_layers 2\) than the one being trained \(num_hidden_layers 3"
    ):
        check_same_model(tmp_path, other)
    check_same_model(tmp_path / "missing", other)  # no config.json: nothing to compare


def test_a_trainer_resume_of_another_models_checkpoint_is_refused_before_loading(make_trainer, tmp_path):
    make_trainer(max_steps=2, save_strategy="steps", save_steps=2).train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    wide = tiny_llama_config().hidden_size * 2
    control = make_trainer(max_steps=3, model=_model(hidden_size=wide))
    with pytest.raises(RuntimeError, match="size mismatch"):  # without attach: transformers' own traceback
        control.train(resume_from_checkpoint=str(ckpt))
    trainer = make_trainer(max_steps=3, model=_model(hidden_size=wide))
    attach(trainer, callbacks=[])
    with pytest.raises(OtherModelError, match=rf"^cannot resume {ckpt}: it holds another model \(hidden_size "):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0 and trainer.model_wrapped is trainer.model  # nothing built or loaded
