"""Llama, Mistral, Qwen2, Qwen3, Gemma 2, Mixtral and Qwen2-MoE described from config.json alone (hf_dist.planning.families) give exactly the spec the
meta model gives on the installed transformers; every config the file does not model goes the meta-model way."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hf_dist.planning.config_checks import position_limit
from hf_dist.planning.families import FAMILIES, describe
from hf_dist.planning.model_source import config_from_dict, resolve_config
from hf_dist.planning.modelinfo import model_spec, spec_from_config
from hf_dist.testing import PUBLIC_CONFIGS, public_config

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             vocab_size=101)  # fmt: skip
CASES = {
    "small": SMALL,
    "defaults": {},  # every size the config class's default (a 7B-class model, counted on meta)
    "tied": dict(SMALL, tie_word_embeddings=True),
    "hub-like": dict(SMALL, architectures=None, torch_dtype="bfloat16", rms_norm_eps=1e-5, rope_theta=500000.0,
                     bos_token_id=1, eos_token_id=[2, 3], use_cache=True, initializer_range=0.02,
                     transformers_version="4.45.0", attention_dropout=0.0, max_position_embeddings=8192),
    "float32": dict(SMALL, dtype="float32"),
    "llama3-rope": dict(SMALL, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}  # fmt: skip
ONLY = {  # keys one family's config class takes
    "llama": {
        "biased": dict(SMALL, attention_bias=True, mlp_bias=True),
        "head_dim": dict(SMALL, head_dim=24),
        "mha": dict(SMALL, num_key_value_heads=None),
    },
    "mistral": {"head_dim": dict(SMALL, head_dim=24), "sliding": dict(SMALL, sliding_window=None, head_dim=None)},
    "qwen2": {
        "sliding": dict(SMALL, sliding_window=32, use_sliding_window=False, max_window_layers=2),
        "mha": dict(SMALL, num_key_value_heads=None),
    },
    "qwen3": {
        "biased": dict(SMALL, attention_bias=True),
        "head_dim": dict(SMALL, head_dim=24),
        "sliding": dict(SMALL, sliding_window=32, use_sliding_window=False, max_window_layers=2),
    },
    "gemma2": {
        "biased": dict(SMALL, attention_bias=True, head_dim=16),
        "uncapped": dict(SMALL, final_logit_softcapping=None, attn_logit_softcapping=None, sliding_window=None),
        "hub-file": dict(
            SMALL,
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            cache_implementation="hybrid",
            sliding_window_size=4096,
            query_pre_attn_scalar=224,
            use_bidirectional_attention=False,
        ),
    },
    "mixtral": {
        "experts": dict(
            SMALL,
            num_local_experts=4,
            num_experts_per_tok=1,
            output_router_logits=True,
            router_aux_loss_coef=0.02,
            router_jitter_noise=0.01,
        ),
        "hub-file": dict(
            SMALL,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
            head_dim=None,
            rope_theta=1000000.0,
            torch_dtype="bfloat16",
            hidden_act="silu",
            output_router_logits=False,
        ),
        "head_dim": dict(SMALL, head_dim=24),
    },
    "qwen2_moe": {
        "experts": dict(
            SMALL,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            output_router_logits=True,
        ),
        "dense-layers": dict(
            SMALL,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            decoder_sparse_step=2,
        ),
        "dense-largest": dict(
            SMALL, intermediate_size=4096, num_experts=2, moe_intermediate_size=8, mlp_only_layers=[2]
        ),
        "unbiased": dict(SMALL, qkv_bias=False, num_experts=4, sliding_window=None, use_sliding_window=False),
        "hub-file": dict(
            SMALL,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
            max_window_layers=21,
            sliding_window=32768,
            use_sliding_window=False,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            torch_dtype="bfloat16",
            router_aux_loss_coef=0.001,
        ),
    },
}


def _cases():
    for family in FAMILIES:
        for case, fields in {**CASES, **ONLY[family]}.items():
            yield pytest.param(family, fields, id=f"{family}-{case}")


def _config(family: str, fields: dict) -> dict:
    data = {"model_type": family, **fields}
    if "architectures" in data:
        data["architectures"] = [FAMILIES[family].causal_lm]
    return data


@pytest.mark.parametrize("family, fields", _cases())
def test_a_described_config_is_the_spec_of_its_meta_model(family, fields, tmp_path):
    data = _config(family, fields)
    assert describe(data) is not None, "this config must be described without transformers"
    (tmp_path / "config.json").write_text(json.dumps(data))
    described, built = model_spec(str(tmp_path)), spec_from_config(config_from_dict(data), name=str(tmp_path))
    for field in dataclasses.fields(built):
        if field.name != "config":
            assert getattr(described, field.name) == getattr(built, field.name), field.name
    assert position_limit(described.config) == position_limit(built.config)  # what a plan reads of the rest


@pytest.mark.parametrize(
    "change",
    [
        {"model_type": "gemma"},  # another family
        {"auto_map": {"AutoModelForCausalLM": "modeling.Mine"}},  # remote code
        {"quantization_config": {"quant_method": "bitsandbytes"}},  # a key this file does not model
        {"architectures": ["LlamaForSequenceClassification"]},
        {"hidden_act": "gelu"},
        {"torch_dtype": "float8_e4m3fn"},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},  # keys transformers requires are missing
        {"intermediate_size": "big"},
        {"attention_bias": 1},
        {"rms_norm_eps": True},
        {"head_dim": 0},
        {"num_attention_heads": 3},  # not a multiple of the KV heads: refused in check_dimensions' words
        {"hidden_size": 66, "head_dim": 24},  # heads do not divide it: transformers 5.24's LlamaConfig refuses
    ],
)
def test_a_config_this_file_does_not_model_is_left_to_the_meta_model(change):
    assert describe({"model_type": "llama", **SMALL, **change}) is None


def test_a_null_that_transformers_refuses_is_left_to_the_meta_model():
    data = {"model_type": "mistral", **SMALL, "num_key_value_heads": None}
    assert describe(data) is None
    try:  # transformers 5.24 refuses it in its own words, as before; 5.0 takes it
        model_spec(data)
    except ValueError as exc:
        assert "invalid mistral config" in str(exc)


# Gemma 2's attention and the experts' tensor-parallel plans are read from transformers' source
@pytest.mark.parametrize("family", ["llama", "gemma2", "mixtral", "qwen2_moe"])
def test_planning_a_described_config_imports_neither_torch_nor_transformers(family, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family, **SMALL}))
    code = (
        "import sys; from hf_dist.planning.modelinfo import model_spec; "
        f"s = model_spec({str(tmp_path)!r}); assert s.num_params > 0; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", [n for n, c in PUBLIC_CONFIGS.items() if c["model_type"] in FAMILIES])
def test_each_public_config_of_these_families_is_described_as_its_meta_model(name):
    described, built = model_spec(dict(PUBLIC_CONFIGS[name])), spec_from_config(public_config(name))
    assert described.config is not built.config and described.num_params == built.num_params
    assert dataclasses.replace(described, config=None) == dataclasses.replace(built, config=None)


def test_a_described_config_becomes_the_transformers_config_where_one_is_needed(tmp_path):
    data = _config("qwen2", CASES["hub-like"])
    (tmp_path / "config.json").write_text(json.dumps(data))
    fields = model_spec(str(tmp_path)).config  # what a trace and FSDP's wrap classes are handed by the plan
    assert resolve_config(fields).to_dict() == config_from_dict(data).to_dict()


@pytest.mark.parametrize(
    "name, request_",
    [
        ("llama-3-8b", ["--gpus", "8", "--gpu-memory", "80", "--global-batch", "64"]),
        ("qwen2.5-7b", ["--gpus", "1", "--gpu-memory", "24", "--method", "lora"]),
        ("llama-3.2-1b", ["--gpus", "2", "--gpu-memory", "24", "--method", "qlora"]),
        ("mistral-7b", ["--gpus", "16", "--nodes", "2", "--gpu-memory", "40", "--global-batch", "32"]),
        ("gemma-2-9b", ["--gpus", "8", "--gpu-memory", "80", "--global-batch", "64", "--seq-len", "8192"]),
        (
            "mixtral-8x7b",
            [
                "--gpus",
                "64",
                "--nodes",
                "8",
                "--gpu-memory",
                "80",
                "--global-batch",
                "128",
                "--seq-len",
                "4096",
                "--strategy",
                "fsdp_full_shard",
                "--activation-checkpointing",
                "on",
            ],
        ),
        ("mixtral-8x7b", ["--gpus", "16", "--nodes", "2", "--gpu-memory", "80", "--method", "lora"]),
        ("qwen1.5-moe-a2.7b", ["--gpus", "8", "--gpu-memory", "40", "--global-batch", "64", "--tp-size", "2"]),
    ],
)
def test_the_plan_of_a_described_config_is_the_plan_of_its_meta_model(name, request_, tmp_path, capsys, monkeypatch):
    from hf_dist.cli.main import main
    from hf_dist.planning import modelinfo

    (tmp_path / "config.json").write_text(json.dumps(dict(PUBLIC_CONFIGS[name])))
    plans = []
    for _ in range(2):
        assert main(["plan", str(tmp_path), *request_, "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
        monkeypatch.setattr(modelinfo, "describe", lambda data, name=None: None)  # the second plan: the meta model
    assert plans[0] == plans[1]


FUZZ = {  # valid and invalid values of every key the families read; sizes small, so each meta model builds fast
    "hidden_size": [64, 66, 48, 0, 64.0, True], "intermediate_size": [96, 0, None], "num_attention_heads": [4, 3, 8, 2],
    "num_key_value_heads": [None, 1, 2, 4, 3], "head_dim": [None, 16, 24, 0], "tie_word_embeddings": [True, False, 1],
    "attention_bias": [True, False, None], "mlp_bias": [True, False], "max_position_embeddings": [128, None],
    "sliding_window": [None, 16, 0], "use_sliding_window": [True, False], "max_window_layers": [1, 28],
    "rms_norm_eps": [1e-5, 1, "x"], "rope_theta": [10000.0, 10000, 0.0], "torch_dtype": ["bfloat16", "float32", "auto"],
    "pretraining_tp": [1, 2], "bos_token_id": [1, None, [1, 2]], "eos_token_id": [2, [2, 3]], "hidden_act": ["silu", "gelu"],
    "rope_scaling": [None, {"rope_type": "linear", "factor": 2.0}, {"type": "dynamic", "factor": 2}, {"rope_type": "llama3",
                     "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}],
}  # fmt: skip
FUZZ_EXPERTS = {  # keys only the mixtures of experts take
    "mixtral": {"num_local_experts": [1, 4, 0, 2.0], "num_experts_per_tok": [1, 2, 5], "router_jitter_noise": [0.0, 0]},
    "qwen2_moe": {"num_experts": [1, 4, 0], "num_experts_per_tok": [1, 2, 5], "moe_intermediate_size": [8, 0],
                  "shared_expert_intermediate_size": [16, None], "mlp_only_layers": [None, [], [0], [True], "0"],
                  "decoder_sparse_step": [1, 2, 0], "qkv_bias": [True, False, None], "norm_topk_prob": [True, 1]},
}  # fmt: skip


def _meta_spec(data: dict):
    return spec_from_config(config_from_dict(data))


def _outcome(build, *args):
    """The spec ``build`` gives, without the fields that name its source; "refused" for a ValueError."""
    try:
        return dataclasses.replace(build(*args), config=None, name=None)
    except ValueError:
        return "refused"


def test_random_configs_described_or_not_agree_with_the_meta_model():
    """Whenever a config is described, the meta model of the same dict gives the same spec, or both refuse it.
    Each key is fuzzed often for a family that takes it and seldom for one that does not (then it is refused)."""
    import random
    from collections import Counter

    from hf_dist.planning import modelinfo
    from hf_dist.planning.families import _ANY_FAMILY

    rng, described = random.Random(0), Counter()
    for _ in range(2000):
        model_type = rng.choice(list(FAMILIES))
        family = FAMILIES[model_type]
        data = {"model_type": model_type, "num_hidden_layers": 2, "vocab_size": 50, "hidden_size": 32,
                "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
        for key, values in {**FUZZ, **FUZZ_EXPERTS.get(model_type, {})}.items():
            if rng.random() < (0.2 if key in family.defaults or key in _ANY_FAMILY else 0.01):
                data[key] = rng.choice(values)
        if describe(data) is None:
            continue
        described[model_type] += 1
        assert _outcome(modelinfo._described_spec, data, "model config") == _outcome(_meta_spec, data), data
    assert min(described[f] for f in FAMILIES) >= 30, described  # the seed describes 40 to 100 of each family
