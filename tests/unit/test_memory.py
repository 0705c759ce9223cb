"""Memory model against hand-computed numbers (the arithmetic is written out in each test)."""

import math

import pytest

from hf_dist.memory import (
    CUDA_FIXED_OVERHEAD_BYTES,
    DS_PREFETCH_BUCKET_ELEMENTS,
    GIB,
    QLORA_BASE_BYTES_PER_PARAM,
    STRATEGIES,
    estimate_memory,
    lora_trainable_params,
)
from hf_dist.modelinfo import model_spec
from hf_dist.testing import tiny_llama_config

P = 1_000_000_000  # a bare 1B-parameter count: no shape, so activations are 0


def est(strategy, world=8, **kw):
    kw.setdefault("overhead", 0)
    return estimate_memory(P, strategy, world, **kw)


def test_ddp_bf16_adamw_is_2_2_12_bytes_per_param_plus_bucket_copy():
    m = est("ddp")
    assert (m.params, m.grads, m.optimizer) == (2 * P, 2 * P, 12 * P)  # ZeRO paper: 2 + 2 + 12
    assert m.buffers == 2 * P  # DDP flat buckets: a second copy of the bf16 gradients
    assert m.activations == 0 and m.model_states == 16 * P
    assert m.total == 18 * P


def test_zero_stages_shard_optimizer_then_grads_then_params():
    z1, z2, z3 = est("zero1", gradient_accumulation_steps=4), est("zero2"), est("zero3")
    assert (z1.params, z1.grads, z1.optimizer) == (2 * P, 2 * P, 12 * P // 8)  # full grads kept across micro-steps
    assert est("zero1").grads == 2 * P // 8  # one micro-step: DeepSpeed keeps only the reduced partition
    assert (z2.params, z2.grads, z2.optimizer) == (2 * P, 2 * P // 8, 12 * P // 8)
    assert (z3.params, z3.grads, z3.optimizer) == (2 * P // 8, 2 * P // 8, 12 * P // 8)
    # stage 1/2 buffer: DeepSpeed reduce bucket 5e8 elements * 2 bytes
    assert z1.buffers == z2.buffers == int(5e8) * 2
    # stage 3: prefetch bucket 5e7 elements * 2 bytes + reduce bucket 5e8 * 2 (no layer size for a bare count)
    assert z3.buffers == DS_PREFETCH_BUCKET_ELEMENTS * 2 + int(5e8) * 2


def test_fsdp_and_hsdp_sharding_degrees():
    full = est("fsdp_full_shard", 16)
    assert full.model_states == 16 * P // 16
    sgo = est("fsdp_shard_grad_op", 16)
    assert (sgo.params, sgo.grads, sgo.optimizer) == (2 * P, 2 * P // 16, 12 * P // 16)
    hsdp = est("hsdp", 16, nodes=2)  # shards over the 8 GPUs of a node, replicates across the 2 nodes
    assert hsdp.model_states == 16 * P // 8


def test_offload_moves_states_to_host():
    z2 = est("zero2", offload="optimizer")
    assert (z2.params, z2.grads, z2.optimizer) == (2 * P, 0, 0)
    assert z2.cpu == P * (12 + 4) // 8  # fp32 master/momentum/variance + fp32 gradient partition per rank
    z3 = est("zero3", offload="optimizer+params")
    assert z3.model_states == 0
    assert z3.cpu == P * (12 + 4 + 2) // 8


@pytest.mark.parametrize(
    ("optimizer", "master", "bytes_per_param"),
    [("adamw", True, 12), ("adamw", False, 8), ("adamw_8bit", True, 2 + 4), ("sgd", True, 4 + 4), ("sgd", False, 4)],
)
def test_optimizer_state_bytes(optimizer, master, bytes_per_param):
    assert est("ddp", optimizer=optimizer, master_weights=master).optimizer == bytes_per_param * P


def test_fp32_training_without_master_weights():
    m = est("ddp", param_bytes=4, grad_bytes=4, master_weights=False)
    assert (m.params, m.grads, m.optimizer) == (4 * P, 4 * P, 8 * P)


def test_default_overhead_is_cuda_context_plus_fragmentation():
    m = estimate_memory(P, "ddp", 8)
    assert m.overhead == CUDA_FIXED_OVERHEAD_BYTES + int(0.05 * 18 * P)


def test_activations_hand_computed_for_tiny_llama():
    spec = model_spec(tiny_llama_config())  # h=64, I=128, heads=4, kv=2, head_dim=16, vocab=256, 2 layers
    m = estimate_memory(spec, "ddp", 1, seq_len=64, micro_batch_size=2, param_bytes=4, grad_bytes=4, overhead=0)
    # per token per layer: elements 8*64 + 4*(2*16) + 4*128 = 1152 -> *4 bytes = 4608,
    # + fp32 RMSNorm inputs 2*4*64 = 512, + fp32 log-sum-exp 4*4 = 16 -> 5136 bytes; 128 tokens
    layer = 5136 * 128
    logits = 256 * (4 + 4) * 128  # fp32 logits + fp32 log-softmax
    assert m.activations == 2 * layer + logits == 1_576_960
    ckpt = estimate_memory(
        spec, "ddp", 1, seq_len=64, micro_batch_size=2, param_bytes=4, grad_bytes=4, overhead=0,
        activation_checkpointing=True,
    )  # fmt: skip
    assert ckpt.activations == 2 * 64 * 128 * 4 + layer + logits  # layer inputs + one recomputed layer + logits
    assert m.buffers == 0  # a single rank has no DDP reducer


def test_bf16_logits_keep_16bit_and_two_fp32_copies():
    spec = model_spec(tiny_llama_config(num_hidden_layers=1))
    m = estimate_memory(spec, "ddp", 1, seq_len=10, overhead=0)
    per_token_layer = (8 * 64 + 4 * 32 + 4 * 128) * 2 + 8 * 64 + 16
    assert m.activations == 10 * (per_token_layer + 256 * (2 + 4 + 4))


def test_lora_trainable_count_matches_peft():
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config()
    spec = model_spec(config)
    # per layer, rank 8: q (64+64) + k,v 2*(64+32) + o (64+64) + gate,up 2*(64+128) + down (128+64) = 1024 * 8
    assert lora_trainable_params(spec, 8) == 2 * 1024 * 8
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    assert lora_trainable_params(spec, 8) == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def test_lora_and_qlora_memory():
    spec = model_spec(tiny_llama_config())
    t = lora_trainable_params(spec, 16)
    lora = estimate_memory(spec, "ddp", 1, method="lora", overhead=0, seq_len=1)
    assert lora.params == spec.num_params * 2 + t * 2
    assert (lora.grads, lora.optimizer) == (t * 2, t * 12)
    q = estimate_memory(spec, "ddp", 1, method="qlora", overhead=0, seq_len=1)
    embeddings = 2 * 256 * 64  # embed_tokens + untied lm_head stay 16-bit
    base = (spec.num_params - embeddings) * QLORA_BASE_BYTES_PER_PARAM + embeddings * 2
    assert q.params == math.ceil(base) + t * 2
    assert abs(QLORA_BASE_BYTES_PER_PARAM - (0.5 + 0.127 / 8)) < 1e-3  # QLoRA paper: 0.127 bits of constants


def test_fsdp_buffers_root_unit_and_two_layers():
    spec = model_spec(tiny_llama_config())
    m = estimate_memory(spec, "fsdp_full_shard", 2, seq_len=1, overhead=0)
    # root (embedding 16384 + lm_head 16384) + 2 layers (2*36992), bf16; + one layer's bf16 grads
    assert m.buffers == (16384 * 2 + 2 * 36992) * 2 + 36992 * 2


def test_estimates_monotone_in_sharding():
    totals = [est(s).model_states for s in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True)
    assert est("zero3", 64).total < est("zero3", 8).total


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "fsdp"}, "allowed: ddp, zero1"),
        ({"offload": "gpu"}, "unknown offload"),
        ({"method": "prefix"}, "unknown method"),
        ({"optimizer": "adafactor"}, "unknown optimizer"),
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"world_size": 6, "nodes": 4}, "not divisible by nodes"),
        ({"strategy": "hsdp", "nodes": 1}, "needs nodes >= 2"),
        ({"strategy": "ddp", "offload": "optimizer"}, "does not support offload"),
        ({"strategy": "fsdp_full_shard", "offload": "optimizer"}, "ZeRO strategy for optimizer-only offload"),
        ({"param_bytes": 3}, "param_bytes must be 1, 2 or 4"),
        ({"method": "lora"}, "need the model's shape"),
        ({"seq_len": 0}, "seq_len must be a positive int"),
    ],
)
def test_bad_arguments_get_clear_errors(kwargs, message):
    args = {"strategy": "zero2", "world_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        estimate_memory(P, args.pop("strategy"), args.pop("world_size"), **args)


def test_every_strategy_gives_positive_total():
    for strategy in STRATEGIES:
        nodes = 2 if strategy == "hsdp" else 1
        assert estimate_memory(P, strategy, 16, nodes=nodes).total > GIB


def test_peak_overlaps_grads_and_activations_only_without_accumulation():
    spec = model_spec(tiny_llama_config())
    kw = dict(seq_len=64, micro_batch_size=2, param_bytes=4, grad_bytes=4, master_weights=False, overhead=0)
    one = estimate_memory(spec, "fsdp_full_shard", 2, **kw)
    assert one.activations > one.grads  # 1.58 MB of activations vs 4 * 106816 / 2 = 0.21 MB of grad shards
    # grads are created in backward as activations are freed: the peak holds the larger one
    assert one.total == one.params + one.optimizer + one.activations + one.buffers
    accum = estimate_memory(spec, "fsdp_full_shard", 2, gradient_accumulation_steps=4, **kw)
    assert accum.total == one.total + one.grads  # accumulated grads live through the next forward
