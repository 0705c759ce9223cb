"""Class attributes read from the installed transformers' source (hf_dist.planning.installed_source) are the ones its
classes hold when imported, and anything not said plainly is UNREAD."""

from __future__ import annotations

import importlib

import pytest

from hf_dist.planning.families import FAMILIES
from hf_dist.planning.installed_source import UNREAD, class_literal

CONFIG_BASES = ("PreTrainedConfig", "PretrainedConfig")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_family_plan_read_from_source_is_the_imported_config_class_plan(model_type):
    config_class = FAMILIES[model_type].causal_lm.removesuffix("ForCausalLM") + "Config"
    module = f"models/{model_type}/configuration_{model_type}.py"
    imported = getattr(importlib.import_module(f"transformers.models.{model_type}"), config_class)
    assert class_literal(module, config_class, "base_model_tp_plan", CONFIG_BASES, None) == imported.base_model_tp_plan


def test_gemma2_sdpa_support_read_from_source_is_the_imported_class_own():
    from transformers.models.gemma2 import modeling_gemma2

    read = class_literal("models/gemma2/modeling_gemma2.py", "Gemma2PreTrainedModel", "_supports_sdpa",
                         ("PreTrainedModel",), False)  # fmt: skip
    assert read is modeling_gemma2.Gemma2PreTrainedModel._supports_sdpa


@pytest.mark.parametrize(
    "module, class_name, attribute, bases",
    [
        ("models/llama/configuration_llama.py", "NoSuchConfig", "base_model_tp_plan", CONFIG_BASES),  # no class
        ("models/no_such/configuration_no_such.py", "LlamaConfig", "base_model_tp_plan", CONFIG_BASES),  # no file
        ("models/llama/configuration_llama.py", "LlamaConfig", "base_model_tp_plan", ("Other",)),  # another base
        ("models/llama/modeling_llama.py", "LlamaPreTrainedModel", "_can_record_outputs", ("PreTrainedModel",)),
        ("models/llama/modeling_llama.py", "LlamaModel", "forward", ("LlamaPreTrainedModel",)),  # a method
    ],
)
def test_what_is_not_said_plainly_is_unread(module, class_name, attribute, bases):
    assert class_literal(module, class_name, attribute, bases, None) is UNREAD


def test_an_attribute_the_class_does_not_assign_is_its_bases_default():
    assert class_literal("models/llama/configuration_llama.py", "LlamaConfig", "no_such", CONFIG_BASES, 7) == 7
