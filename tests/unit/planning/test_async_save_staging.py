"""The planner counts async_save's staging copy in host RAM (hf_dist.checkpoint.lifecycle.async_save stages what each rank
writes): FSDP2 every rank its shards, DDP rank 0 alone, DeepSpeed nothing (it saves synchronously)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

import hf_dist
from hf_dist.planning.plan_result import PlanError, format_bytes

LLAMA3_8B = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256)  # fmt: skip
GIB = 1024**3


def test_fsdp2_stages_every_ranks_shards_of_weights_and_optimizer():
    plan = hf_dist.plan(LLAMA3_8B, gpus=8, gpu_memory_gib=80, strategy="fsdp_full_shard", async_save=True,
                        host_memory_gib=1024)  # fmt: skip
    assert plan.staging_bytes == 8 * (plan.memory.params + plan.memory.optimizer)
    assert plan.staging_bytes / GIB == pytest.approx(8.03e9 * 12 / GIB, rel=0.01)  # fp32 weights + Adam: 12 B/param
    assert f"host RAM for async_save's staging copy: {format_bytes(plan.staging_bytes)} per node" in plan.explain()
    assert hf_dist.plan(LLAMA3_8B, gpus=8, gpu_memory_gib=80, strategy="fsdp_full_shard").staging_bytes is None


def test_deepspeed_stages_nothing_and_says_why():
    plan = hf_dist.plan(LLAMA3_8B, gpus=8, gpu_memory_gib=80, strategy="zero2", async_save=True, host_memory_gib=1024)
    assert plan.staging_bytes == 0
    assert "async_save's staging copy: none: DeepSpeed writes its checkpoint itself, synchronously" in plan.explain()


def test_ddp_stages_rank_0s_states_only():
    small = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                        vocab_size=32000)  # fmt: skip
    plan = hf_dist.plan(small, gpus=8, gpu_memory_gib=80, strategy="ddp", async_save=True, host_memory_gib=1024)
    assert plan.staging_bytes == plan.memory.params + plan.memory.optimizer  # one rank's, not eight


def test_staging_next_to_offloaded_states_can_refuse_a_layout():
    """FSDP2 offloading to a 280 GiB host: the offloaded states fit, the same again as a staging copy does not."""
    kwargs = dict(gpus=8, gpu_memory_gib=24, strategy="fsdp_full_shard", host_memory_gib=280)
    assert hf_dist.plan(LLAMA3_8B, **kwargs).offload == "optimizer+params"
    with pytest.raises(
        PlanError, match=r"async_save's staging copy \(134\.62 GiB\) and offloaded states need 269\.24 GiB"
    ):
        hf_dist.plan(LLAMA3_8B, async_save=True, **kwargs)
