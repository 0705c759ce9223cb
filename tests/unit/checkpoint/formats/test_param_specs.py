import pytest
import torch

from hf_dist.checkpoint.formats.param_specs import llama_like_specs


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
        ("llama", {"head_dim": 24, "num_key_value_heads": 1}),
        ("mistral", {"tie_word_embeddings": False}),
    ],
)
def test_matches_transformers_meta_model(model_type, overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)  # fmt: skip
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes, tied = llama_like_specs(config.to_dict())
    assert shapes == expected
    assert tied == dict(getattr(model, "all_tied_weights_keys", None) or {})


def test_other_architectures_fall_back():
    assert llama_like_specs({"model_type": "gpt2"}) is None
    assert llama_like_specs({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}) is None
