"""Parameter counts from configs on the meta device equal those of really instantiated models."""

import json
import time

import pytest
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, ViTConfig

from hf_dist.planning.modelinfo import ModelSpec, model_spec
from hf_dist.testing import tiny_llama_config

TINY = {
    "llama": tiny_llama_config(),
    "llama_tied": tiny_llama_config(tie_word_embeddings=True),
    "mistral": MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen2": Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "gpt2": GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TINY))
def test_counts_equal_real_instantiation(name):
    config = TINY[name]
    model = AutoModelForCausalLM.from_config(config)
    spec = model_spec(config)
    assert spec.num_params == sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights
    assert spec.num_layers == config.num_hidden_layers
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    assert spec.layer_params == sum(p.numel() for p in layers[0].parameters())
    assert spec.embedding_params == model.get_input_embeddings().weight.numel()
    assert spec.tie_word_embeddings == bool(config.tie_word_embeddings)
    assert model_spec(model).num_params == spec.num_params


def test_shape_fields_for_llama():
    spec = model_spec(tiny_llama_config())
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads) == (64, 4, 2)
    assert (spec.intermediate_size, spec.vocab_size, spec.head_dim, spec.model_type) == (128, 256, 16, "llama")
    assert model_spec(TINY["gpt2"]).intermediate_size == 4 * 32  # GPT-2: n_inner=None means 4*hidden


def test_peft_wrapped_counts_base_params_only():
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    base = sum(p.numel() for p in model.parameters())
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert sum(p.numel() for p in wrapped.parameters()) > base  # adapters were added...
    assert model_spec(wrapped).num_params == base  # ...and are not counted as base params


def test_dict_file_and_folder_inputs(tmp_path):
    config = tiny_llama_config()
    expected = model_spec(config).num_params
    assert model_spec(config.to_dict()).num_params == expected
    config.save_pretrained(tmp_path)
    assert model_spec(str(tmp_path)).num_params == expected
    assert model_spec(tmp_path / "config.json").num_params == expected


def test_int_and_spec_inputs():
    assert model_spec(7_000_000_000) == ModelSpec(num_params=7_000_000_000)
    assert model_spec(7.5e9) == ModelSpec(num_params=7_500_000_000)  # an integral float is a count
    spec = ModelSpec(num_params=5)
    assert model_spec(spec) is spec


def test_405b_config_counts_in_about_a_second():
    config = LlamaConfig(
        hidden_size=16384, num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
        intermediate_size=53248, vocab_size=128256,
    )  # fmt: skip
    start = time.process_time()  # CPU time: other jobs on a shared machine do not inflate it
    spec = model_spec(config)
    elapsed = time.process_time() - start
    # 126 layers * (4 attention mats + 3 MLP mats + 2 norms) + embeddings + lm_head + final norm
    h, kv, inter, vocab = 16384, 8 * 128, 53248, 128256
    layer = h * h * 2 + 2 * h * kv + 3 * h * inter + 2 * h
    assert spec.layer_params == layer
    assert spec.num_params == 126 * layer + 2 * vocab * h + h == 405_853_388_800
    assert elapsed < 10  # ~0.6 s of CPU; a materialised model would take minutes


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        ("no-such-org/no-such-model", ValueError, "could not be resolved.*local folder or a config.json"),
        (ViTConfig(), ValueError, "not a causal language model"),
        ({"hidden_size": 8}, ValueError, "no 'model_type'"),
        ({"model_type": "not-a-model"}, ValueError, "unknown model_type"),
        (True, ValueError, "parameter count"),
        (object(), ValueError, "cannot describe a model of type object"),
        (0, ValueError, "num_params must be positive"),
        (7.5, ValueError, r"must be a whole number, got 7\.5 \(not integral\)"),
        (float("nan"), ValueError, "must be a whole number, got nan"),
        (-1e9, ValueError, "num_params must be a non-negative int, got -1000000000"),
    ],
)
def test_bad_models(model, error, message):
    with pytest.raises(error, match=message):
        model_spec(model)


def test_folder_without_config_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_spec(str(tmp_path))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        model_spec(str(bad))
    bad.write_text(json.dumps(ViTConfig().to_dict()))
    with pytest.raises(ValueError, match="not a causal language model"):
        model_spec(str(bad))


def test_meta_counting_allocates_no_storage():
    psutil = pytest.importorskip("psutil")
    config = tiny_llama_config(hidden_size=4096, intermediate_size=11008, num_hidden_layers=4, vocab_size=32000)
    before = psutil.Process().memory_info().rss
    assert model_spec(config).num_params > 500_000_000  # 2 GB of fp32 weights if they were allocated
    assert psutil.Process().memory_info().rss - before < 300 * 1024**2


def test_a_count_written_as_text_is_never_a_hub_name():
    from hf_dist.planning.modelinfo import model_spec

    assert model_spec("7.5e9").num_params == 7_500_000_000 and model_spec("8000000000").num_params == 8_000_000_000


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    """Without network, huggingface_hub retries for ~25 s; hf_dist checks the endpoint first (about a second)."""
    import time

    from huggingface_hub import constants

    from hf_dist.planning.modelinfo import model_spec

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"could not resolve model 'org/model'.*cannot be reached.*HF_HUB_OFFLINE=1"):
        model_spec("org/model")
    assert time.perf_counter() - start < 2


def test_position_limit_is_max_position_embeddings_unless_rope_is_scaled():
    from hf_dist.planning.config_checks import check_seq_len, position_limit
    from hf_dist.testing import llama3_config, public_config

    assert position_limit(llama3_config("Llama-3-8B")) == 8192
    assert position_limit(TINY["gpt2"]) == 64  # GPT-2's n_positions
    assert position_limit(llama3_config("Llama-3.1-8B")) is None  # llama3 RoPE scaling: the scaling decides
    assert position_limit(public_config("deepseek-v2-lite")) is None  # yarn, in the older rope_scaling form
    assert position_limit(model_spec(7_000_000)) is None  # a bare count knows no positions
    check_seq_len(8192, llama3_config("Llama-3-8B"))
    check_seq_len(1_000_000, llama3_config("Llama-3.1-8B"))
    with pytest.raises(ValueError) as refused:
        check_seq_len(100000, llama3_config("Llama-3-8B"), name="--seq-len")
    assert str(refused.value) == (
        "--seq-len 100000 exceeds the model's max_position_embeddings=8192 (its config scales no RoPE); "
        "use --seq-len <= 8192, or a model (or rope_scaling) with longer context"
    )
