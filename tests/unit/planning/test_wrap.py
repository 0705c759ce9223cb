"""fsdp_wrap_classes on tiny configs of several architectures, PEFT-wrapped models and bad input."""

import pytest
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM

from hf_dist.planning.wrap import block_candidates, fsdp_wrap_classes
from hf_dist.testing import tiny_llama_config

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)

ARCHS = {
    "llama": ({**SMALL, "num_key_value_heads": 2}, "LlamaDecoderLayer"),
    "mistral": ({**SMALL, "num_key_value_heads": 2}, "MistralDecoderLayer"),
    "qwen2": ({**SMALL, "num_key_value_heads": 2}, "Qwen2DecoderLayer"),
    "gemma": ({**SMALL, "num_key_value_heads": 1, "head_dim": 16}, "GemmaDecoderLayer"),
    "phi3": ({**SMALL, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, "Phi3DecoderLayer"),
    "gpt2": ({"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256}, "GPT2Block"),
}


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_detects_decoder_layer_from_config(model_type):
    kwargs, expected = ARCHS[model_type]
    assert fsdp_wrap_classes(AutoConfig.for_model(model_type, **kwargs)) == [expected]


def test_config_dict_and_local_folder(tmp_path):
    cfg = tiny_llama_config()
    cfg.save_pretrained(tmp_path)
    assert fsdp_wrap_classes(str(tmp_path)) == ["LlamaDecoderLayer"]
    assert fsdp_wrap_classes(str(tmp_path / "config.json")) == ["LlamaDecoderLayer"]
    assert fsdp_wrap_classes({"model_type": "qwen2", **ARCHS["qwen2"][0]}) == ["Qwen2DecoderLayer"]


def test_peft_lora_wrapped_llama():
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert type(wrapped).__name__ == "PeftModel"
    assert fsdp_wrap_classes(wrapped) == ["LlamaDecoderLayer"]
    assert type(wrapped.base_model).__name__ == "LoraModel"
    assert fsdp_wrap_classes(wrapped.base_model) == ["LlamaDecoderLayer"]


def test_requested_class_validated_with_candidates():
    cfg = tiny_llama_config()
    assert fsdp_wrap_classes(cfg, ["LlamaDecoderLayer"]) == ["LlamaDecoderLayer"]
    with pytest.raises(
        ValueError, match=r"\['LlamaBlock'\] not found.*Candidates found in this model: \['LlamaDecoderLayer'\]"
    ):
        fsdp_wrap_classes(cfg, ["LlamaBlock"])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)


class Tiny(nn.Module):
    # Declares a class that is never instantiated: detection must not trust it blindly.
    _no_split_modules = ["GhostLayer"]

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # smaller repeated list
        self.layers = nn.ModuleList([Block() for _ in range(3)])


def test_absent_no_split_modules_fall_back_to_largest_repeated_block():
    model = Tiny()
    assert block_candidates(model) == ["Block", "Linear"]
    assert fsdp_wrap_classes(model) == ["Block"]


def test_no_block_found_raises():
    with pytest.raises(ValueError, match="Could not find a repeated block"):
        fsdp_wrap_classes(nn.Sequential(nn.Linear(2, 2)))


def test_unresolvable_name_raises_clear_error():
    with pytest.raises(ValueError, match="could not resolve model 'no-such-org/no-such-model'"):
        fsdp_wrap_classes("no-such-org/no-such-model")


def test_unsupported_type_raises():
    with pytest.raises(ValueError, match="object of type float"):
        fsdp_wrap_classes(1.5)
