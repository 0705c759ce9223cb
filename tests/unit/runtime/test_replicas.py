"""Replicas agree: ranks with different trainable parameters are refused where the engine would train a mix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_dist.runtime import replicas


def _lora(seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from hf_dist.testing import tiny_llama_config

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())
    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))


def test_checksums_cover_only_trainable_parameters():
    sums = replicas.checksums(_lora(1))
    assert sums and all("lora_" in name for name in sums)


def test_differing_names_what_any_rank_holds_otherwise():
    assert replicas.differing([{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}]) == []
    assert replicas.differing([{"a": 1.0, "b": 2.0}, {"a": 1.5, "c": 2.0}]) == ["a", "b", "c"]


def _two_ranks(monkeypatch, other, *, fsdp):
    """This process as rank 0 of 2, rank 1 holding ``other``; the engine FSDP2 (no broadcast) or DDP."""
    monkeypatch.setattr(replicas._dist, "world_size", lambda: 2)
    monkeypatch.setattr(replicas._dist, "rank", lambda: 0)
    monkeypatch.setattr(replicas._dist, "gather_objects", lambda mine: [mine, replicas.checksums(other)])
    plugin = SimpleNamespace(cpu_ram_efficient_loading=False) if fsdp else None
    monkeypatch.setattr(replicas._dist, "accelerator_state", lambda: SimpleNamespace(fsdp_plugin=plugin))


def test_unseeded_adapters_under_fsdp2_are_refused_naming_the_fix(monkeypatch):
    _two_ranks(monkeypatch, _lora(2), fsdp=True)
    # lora_B starts at zero on every rank: only the two lora_A differ
    with pytest.raises(replicas.ReplicaMismatchError, match=r"^the 2 ranks hold different trainable parameters \(2: .*lora_A"
                       r".*FSDP2 would shard and train a mix of them; seed before .*get_peft_model"):  # fmt: skip
        replicas.check_replicas_agree(_lora(1))
    replicas.check_replicas_agree(_lora(2))  # seeded alike: no refusal


def test_an_engine_that_broadcasts_rank_0s_copy_is_not_checked(monkeypatch):
    """DDP, DeepSpeed, FSDP2 with cpu_ram_efficient_loading: the difference is harmless (and expected under the
    latter, whose other ranks load no weights), so nothing is gathered or said."""
    _two_ranks(monkeypatch, _lora(2), fsdp=False)
    monkeypatch.setattr(replicas._dist, "gather_objects", lambda mine: pytest.fail("gathered"))
    replicas.check_replicas_agree(_lora(1))
