"""The user's LoRA is what is planned: a PeftModel's config, ``peft_config=`` and the LoRA keywords give the trainable
parameters PEFT really trains, the dropout changes the activations by its masks, and what cannot be planned is
refused by name (issue 33)."""

from __future__ import annotations

import pytest
import torch

from hf_dist.planning.lora import LoraSpec, from_peft_config
from hf_dist.planning.lora_plan import place, resolve, same_adapters
from hf_dist.planning.memory import estimate_memory
from hf_dist.planning.modelinfo import model_spec
from hf_dist.planning.planner import plan

peft = pytest.importorskip("peft")

KW = dict(gpus=1, gpu_memory_gib=80)


def config(**overrides):
    from transformers import LlamaConfig

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(**{**kw, **overrides})


def peft_model(lora_config, **overrides):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config(**overrides))
    return peft.get_peft_model(base, lora_config)


def trained(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


CASES = {
    # the issue's case: rank 64 on q/v only (the planner counted rank 16 on every linear: 147,968)
    "rank 64 q/v": (dict(r=64, target_modules=["q_proj", "v_proj"]), {}),
    "all-linear rank 8": (dict(r=8, target_modules="all-linear"), {}),
    "modules_to_save lm_head": (dict(r=8, target_modules=["q_proj"], modules_to_save=["lm_head"]), {}),
    "bias lora_only": (dict(r=8, target_modules=["q_proj", "o_proj"], bias="lora_only"), {"attention_bias": True}),
    "bias all": (dict(r=8, target_modules=["q_proj", "o_proj"], bias="all"), {"attention_bias": True}),
    "layers, rank_pattern": (
        dict(r=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1, 3], rank_pattern={"v_proj": 4}),
        {},
    ),  # fmt: skip
    "regex, exclude, lora_bias": (
        dict(r=8, target_modules=r".*\.(q|v)_proj", lora_bias=True, exclude_modules=["layers.0.self_attn.q_proj"]),
        {},
    ),  # fmt: skip
    "rsLoRA, tied head": (
        dict(r=8, target_modules=["q_proj"], use_rslora=True, modules_to_save=["lm_head"]),
        {"tie_word_embeddings": True},
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_counted_trainable_parameters_are_what_peft_trains(case):
    kwargs, overrides = CASES[case]
    model = peft_model(peft.LoraConfig(**kwargs), **overrides)
    real = trained(model)
    from_model = plan(model, **KW)
    before = plan(config(**overrides), peft_config=peft.LoraConfig(**kwargs), **KW)  # before the model exists
    assert from_model.trainable_params == before.trainable_params == real
    assert (
        from_model.method == "lora" and from_model.lora.source == "PeftModel" and before.lora.source == "peft_config"
    )
    assert same_adapters(from_model.lora, before.lora, model_spec(model))  # PEFT rewrites "all-linear" into names
    # the memory model holds the same parameters: a 16-bit base + fp32 adapters, fp32 grads and two fp32 moments
    memory = estimate_memory(model, "ddp", 1, seq_len=8)
    added = from_model.trainable_params - (real - place(model_spec(model), from_model.lora).new_params)
    assert (memory.grads, memory.optimizer) == (4 * real, 8 * real)
    assert memory.params == 2 * model_spec(model).num_params + 4 * added + 2 * (real - added)


def test_the_issue_case_counts_114688_not_147968():
    model = peft_model(peft.LoraConfig(r=64, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    p = plan(model, **KW)
    assert p.trainable_params == trained(model) == 114_688
    assert (
        "lora: r=64, alpha=8, dropout 0 on q_proj, v_proj (the PeftModel's config): 114,688 trainable" in p.explain()
    )
    assert plan(config(), method="lora", **KW).trainable_params == 16 * 1024 * 8 == 131_072  # the recipes' default


def test_keywords_adjust_the_recipes_lora_and_must_agree_with_a_given_config():
    method, spec = resolve(config(), None, lora_rank=64, lora_dropout=0.0, lora_targets="q_proj,v_proj")
    assert method == "lora" and (spec.rank, spec.dropout, spec.targets, spec.source) == (
        64, 0.0, ("q_proj", "v_proj"), "keywords")  # fmt: skip
    assert resolve(config(), None) == ("full", None)
    assert resolve(config(), "lora")[1] == LoraSpec()  # r=16, alpha 32, dropout 0.05, every linear of the block
    model = peft_model(peft.LoraConfig(r=64, target_modules=["q_proj", "v_proj"]))
    assert resolve(model, None, lora_rank=64)[1].rank == 64  # saying what the model says is fine
    with pytest.raises(ValueError, match=r"lora_rank=16 but the PeftModel's config has 64: its own LoRA is planned; "
                                         r"drop lora_rank"):  # fmt: skip
        plan(model, lora_rank=16, **KW)
    with pytest.raises(
        ValueError, match=r"the PeftModel's LoRA \(r=64.*\) and peft_config \(r=8.*\) differ; pass one"
    ):
        plan(model, peft_config=peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]), **KW)
    with pytest.raises(ValueError, match=r"method='full' trains every weight, but a PeftModel describes LoRA"):
        plan(model, method="full", **KW)


def test_dropout_changes_the_activations_by_its_masks():
    """Per token, each adapter whose input needs a gradient saves a 1-byte mask (torch native_dropout); the copies
    exist either way under DDP (fp32 adapters cast their input). Layer 0's q/k/v read the frozen embedding's output,
    which needs no gradient: no mask there. 8 layers x (64 q + 64 k + 64 v + 64 o + 64 gate + 64 up + 128 down)
    - 3 x 64 = 3,904 bytes per token."""
    tokens = 32 * 2
    kw = dict(seq_len=32, micro_batch_size=2)
    with_dropout = estimate_memory(config(), "ddp", 1, method="lora", lora_dropout=0.05, **kw)
    without = estimate_memory(config(), "ddp", 1, method="lora", lora_dropout=0.0, **kw)
    assert with_dropout.activations - without.activations == (8 * 512 - 3 * 64) * tokens


@pytest.mark.parametrize(
    ("lora_config", "message"),
    [
        (lambda: peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]),
         r"peft_config is a IA3 adapter \(peft_type 'IA3'\); hf_dist plans LoRA adapters only"),
        (lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
         r"is a PREFIX_TUNING adapter"),
        (lambda: peft.LoraConfig(target_modules=["q_proj"], use_dora=True),
         r"peft_config sets use_dora=True: DoRA runs each adapted linear's base weight again.*drop use_dora"),
        (lambda: peft.LoraConfig(target_modules=["q_proj", "qkv_proj"]),
         r"peft_config: target_modules name 'qkv_proj' matches no module of the model; its modules are named "
         r"\[.*'q_proj'"),
        (lambda: peft.LoraConfig(target_modules=["embed_tokens"]),
         r"LoRA target model.embed_tokens is an embedding module .*hf_dist plans LoRA on linear layers"),
        (lambda: peft.LoraConfig(target_modules=["q_proj"], modules_to_save=["score"]),
         r"modules_to_save name 'score' matches no module"),
        (lambda: peft.LoraConfig(target_modules=r".*\.qkv"), r"target_modules regex '.\*\\\\.qkv' matches no module"),
    ],
)  # fmt: skip
def test_what_cannot_be_planned_is_refused_by_name(lora_config, message):
    with pytest.raises(ValueError, match=message):
        plan(config(), peft_config=lora_config(), **KW)


def test_a_spec_round_trips_through_its_dict_and_peft():
    spec = from_peft_config(peft.LoraConfig(r=32, lora_alpha=64, lora_dropout=0.1, target_modules=["q_proj"],
                                            modules_to_save=["lm_head"], bias="lora_only", use_rslora=True))  # fmt: skip
    assert LoraSpec.from_dict(spec.to_dict()) == spec
    assert from_peft_config(peft.LoraConfig(**spec.peft_kwargs())).same_run(spec)
    with pytest.raises(ValueError, match=r"lora_dropout must be in \[0, 1\), got 1.5 \(the lora_\* keywords\)"):
        LoraSpec(dropout=1.5, source="keywords")
