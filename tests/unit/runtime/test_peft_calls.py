"""A LoRA run's PEFT calls raise no `is_gradient_checkpointing is deprecated` warning (3 per run before)."""

from __future__ import annotations

import json
import warnings

import pytest

from hf_dist.testing import tiny_llama_config

pytest.importorskip("peft")


def _deprecations(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the suite's filterwarnings ignores FutureWarning; record it here
        result = call()
    return result, [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_llama_config())


def test_recipe_lora_wrap_and_export_reload_raise_no_deprecation(tmp_path):
    from hf_dist.recipe_utils.flags import LoraArguments
    from hf_dist.recipe_utils.model import apply_lora
    from hf_dist.runtime.peft_calls import load_peft_model

    peft_model, warned = _deprecations(lambda: apply_lora(_model(), LoraArguments()))
    assert warned == []
    peft_model.save_pretrained(tmp_path / "adapter")
    _model().save_pretrained(tmp_path / "base")
    config_file = tmp_path / "adapter" / "adapter_config.json"  # a model built from a config has no name: give it one
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "base_model_name_or_path": str(tmp_path / "base")})
    )
    reloaded, warned = _deprecations(lambda: load_peft_model(tmp_path / "adapter"))
    assert warned == [] and type(reloaded).__name__ == "PeftModelForCausalLM"


def test_the_tracers_lora_model_raises_no_deprecation():
    from hf_dist.tracing.prepare import _add_lora
    from hf_dist.tracing.setup import TraceSetup

    setup = TraceSetup("ddp", method="lora", mixed_precision="no", base_dtype="float32")
    _, warned = _deprecations(lambda: _add_lora(_model(), setup))
    assert warned == []


def test_only_that_message_is_filtered():
    from hf_dist.runtime.peft_calls import without_peft_deprecation

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with without_peft_deprecation():
            message = "`is_gradient_checkpointing` is deprecated and will be removed in v6."
            warnings.warn(message, FutureWarning, stacklevel=1)
            warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another deprecation"]
