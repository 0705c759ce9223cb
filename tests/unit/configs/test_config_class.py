"""auto_args(config_class=...) for TrainingArguments subclasses: TRL's SFTConfig defaults never replace the plan."""

from __future__ import annotations

import pytest

from hf_dist.auto import auto_args
from hf_dist.planning.features import installed_features
from hf_dist.testing import tiny_llama_config

trl = pytest.importorskip("trl", reason="the trl extra (hf_dist[trl]) is not installed in this environment")
CFG = tiny_llama_config(max_position_embeddings=2048)  # positions for SFTConfig's max_length=1024
AC_FLAG = installed_features().activation_checkpointing_field


def test_sft_config_gets_the_plan_not_its_own_defaults(tmp_path):
    kw = auto_args(CFG, strategy="ddp", gpus=2, config_class=trl.SFTConfig, packing=True)
    # SFTConfig defaults: gradient_checkpointing=True, bf16 by device, max_length=1024 -- all said explicitly here
    assert kw[AC_FLAG] is False and kw["bf16"] is False and kw["fp16"] is False
    assert kw["max_length"] == 1024 and kw["packing"] is True  # the class default became the plan's seq_len
    config = trl.SFTConfig(output_dir=str(tmp_path), **kw)
    assert not config.activation_checkpointing and not config.gradient_checkpointing and not config.bf16
    assert config.per_device_train_batch_size == kw["per_device_train_batch_size"] and config.max_length == 1024
    # ... but not beyond the model's positions (the embedded model's 256)
    with pytest.raises(ValueError, match=r"seq_len 1024 exceeds the model's max_position_embeddings=256"):
        auto_args(tiny_llama_config(), strategy="ddp", gpus=2, config_class=trl.SFTConfig)


def test_sft_config_fields_are_planned_or_refused():
    kw = auto_args(CFG, strategy="ddp", gpus=2, config_class=trl.SFTConfig, max_length=256)
    assert kw["max_length"] == 256
    same = auto_args(CFG, strategy="ddp", gpus=2, config_class=trl.SFTConfig, max_length=256, seq_len=256)
    assert same["max_length"] == 256
    with pytest.raises(ValueError, match=r"max_length=512 contradicts the plan's seq_len 256: they are the same"):
        auto_args(CFG, strategy="ddp", gpus=2, config_class=trl.SFTConfig, max_length=512, seq_len=256)
    with pytest.raises(ValueError, match=r"padding_free=True without packing: SFTConfig's trainer then does not"):
        auto_args(CFG, strategy="ddp", gpus=2, config_class=trl.SFTConfig, padding_free=True)
    assert auto_args(CFG, strategy="ddp", gpus=2, config_class=trl.SFTConfig, padding_free=True, packing=True)
    with pytest.raises(ValueError, match=r"activation_offloading=True moves saved activations to host memory"):
        auto_args(CFG, strategy="ddp", gpus=2, config_class=trl.SFTConfig, activation_offloading=True)
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['packing'\]: not fields of TrainingArguments"):
        auto_args(CFG, strategy="ddp", gpus=2, packing=True)  # a TRL field without config_class
    with pytest.raises(ValueError, match="config_class must be TrainingArguments or a subclass"):
        auto_args(CFG, strategy="ddp", gpus=2, config_class=dict)


def test_an_sft_config_left_to_its_defaults_is_refused_at_train_start(tmp_path):
    """Without auto_args' explicit values SFTConfig checkpoints (its default): the plan's contract stops the run."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    import hf_dist
    from hf_dist.callbacks import attach
    from hf_dist.callbacks.plan import PlanMismatchError
    from hf_dist.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(model_max_length=32)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=len(tokenizer)))
    plan = hf_dist.plan(model, gpus=1, seq_len=32, global_batch_size=2, strategy="ddp")
    config = trl.SFTConfig(output_dir=str(tmp_path), max_length=32, max_steps=1, per_device_train_batch_size=2,
                           use_cpu=True, report_to=[])  # fmt: skip
    data = Dataset.from_dict({"text": [f"{i} plus {i}" for i in range(8)]})
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    attach(trainer, plan=plan)
    with pytest.raises(PlanMismatchError, match="activation checkpointing: planned False, running True"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_sft_trainers_fused_lm_head_is_planned_and_a_plan_without_it_refused():
    import hf_dist
    from hf_dist.configs.config_class import plan_from_class

    plan_kwargs = {}
    plan_from_class(trl.SFTConfig, plan_kwargs, {})
    assert plan_kwargs == {"fused_lm_head": True, "seq_len": 1024}  # SFTTrainer's loss never holds the logits
    smoothed = {}
    plan_from_class(trl.SFTConfig, smoothed, {"label_smoothing_factor": 0.1})
    assert smoothed["fused_lm_head"] is False  # label smoothing runs on the full logits
    plan = hf_dist.plan(CFG, gpus=2, strategy="ddp", seq_len=1024)
    with pytest.raises(ValueError, match=r"SFTConfig's trainer computes the loss through its fused LM head"):
        auto_args(CFG, plan=plan, config_class=trl.SFTConfig)
    fused = hf_dist.plan(CFG, gpus=2, strategy="ddp", seq_len=1024, fused_lm_head=True)
    assert auto_args(CFG, plan=fused, config_class=trl.SFTConfig)["max_length"] == 1024
    assert "loss through TRL's fused LM head" in fused.explain()
    with pytest.raises(ValueError, match=r"fused_lm_head=True: drop fused_lm_head"):
        auto_args(CFG, gpus=2, fused_lm_head=True, config_class=trl.SFTConfig, label_smoothing_factor=0.1)
