"""Memory model against hand-computed numbers (the arithmetic is written out in each test)."""

import math

import pytest

from hf_dist.planning.dtypes import GIB, engine_dtypes
from hf_dist.planning.layout import STRATEGIES
from hf_dist.planning.memory import estimate_memory
from hf_dist.planning.model_states import QLORA_BASE_BYTES_PER_PARAM, lora_trainable_params
from hf_dist.planning.modelinfo import model_spec
from hf_dist.planning.transients import (
    CUDA_CONTEXT_BYTES,
    DS_MAX_LIVE_PARAMETERS,
    DS_REDUCE_BUCKET_ELEMENTS,
    NCCL_BYTES,
    compute_stream_reserve_bytes,
    lora_input_cast_bytes,
)
from hf_dist.testing import tiny_llama_config

P = 1_000_000_000  # a bare 1B-parameter count: no shape, so activations are 0
B = DS_REDUCE_BUCKET_ELEMENTS


def est(strategy, world=8, **kw):
    return estimate_memory(P, strategy, world, **kw)


def test_layouts_per_engine():
    # DDP mixed: fp32 weights/grads/moments, bf16 compute under autocast with an fp32 residual stream
    assert engine_dtypes("ddp", 2, True) == engine_dtypes("ddp", 2, True, "full")
    ddp = engine_dtypes("ddp", 2, True)
    assert (ddp.weights, ddp.master, ddp.grads, ddp.state, ddp.compute, ddp.residual, ddp.autocast) == (
        4, 0, 4, 4, 2, 4, True,
    )  # fmt: skip
    fsdp = engine_dtypes("fsdp_full_shard", 2, True)  # fp32 shards, bf16 gathered compute, no autocast
    assert (fsdp.weights, fsdp.grads, fsdp.compute, fsdp.residual, fsdp.autocast) == (4, 4, 2, 2, False)
    z3 = engine_dtypes("zero3", 2, True)  # bf16 module weights + fp32 master partition, fp32 grad accumulation
    assert (z3.weights, z3.master, z3.grads, z3.compute) == (2, 4, 4, 2)
    pure = engine_dtypes("ddp", 2, False)  # pure bf16: everything 16-bit
    assert (pure.weights, pure.master, pure.grads, pure.state, pure.residual) == (2, 0, 2, 2, 2)
    lora = engine_dtypes("ddp", 2, True, "lora")  # frozen 16-bit base: bf16 compute and residual, no autocast casts
    assert (lora.residual, lora.autocast) == (2, False)


def test_ddp_mixed_is_4_4_8_bytes_per_param_and_pure_bf16_2_2_4():
    m = est("ddp", 1)
    assert (m.params, m.grads, m.optimizer) == (4 * P, 4 * P, 8 * P)
    assert m.buffers == 2 * P  # autocast's bf16 copy of every linear weight (a bare count: all of them)
    pure = est("ddp", 1, master_weights=False)
    assert (pure.params, pure.grads, pure.optimizer, pure.buffers) == (2 * P, 2 * P, 4 * P, 0)
    assert est("ddp", 8).buffers == 2 * P + 4 * P  # + the Reducer's fp32 bucket copy of the gradients


def test_zero_stages():
    z1, z2, z3 = est("zero1"), est("zero2"), est("zero3")
    # ZeRO-1 in bf16 with fp32 accumulation is BF16_Optimizer: a full fp32 grad buffer, kept; its bf16 grads live
    # from backward to the step, next to the bf16 copy the fp32 grads are all-reduced in (one group: a bare count)
    assert (z1.params, z1.grads, z1.optimizer) == (2 * P, 4 * P, 12 * P // 8)
    assert not z1.grads_overlap_activations
    assert z1.step == 2 * P + 2 * P
    # ZeRO-2: fp32 gradient partition, freed after the step; buckets only in backward
    assert (z2.params, z2.grads, z2.optimizer, z2.buffers) == (2 * P, 4 * P // 8, 12 * P // 8, 0)
    assert z2.step == 2 * B * 2  # two bf16 buckets (overlap_comm); a bare count has no largest parameter
    assert z2.grads_overlap_activations
    # ZeRO-3: everything partitioned; the fp32 grad partition and the bf16 reduce bucket live from init
    assert (z3.params, z3.grads, z3.optimizer) == (2 * P // 8, 4 * P // 8, 12 * P // 8)
    # + up to stage3_max_live_parameters gathered (world > 1), with the logits too, released before the step
    assert z3.buffers == B * 2 + DS_MAX_LIVE_PARAMETERS * 2 and z3.unit_buffers == 0
    assert z3.released_at_step == DS_MAX_LIVE_PARAMETERS * 2
    assert est("zero3", 1).buffers == B * 2  # one rank gathers nothing
    assert not z3.grads_overlap_activations
    assert z3.step == P // 8 * 4  # flattened fp32 gradient of the (one) sub-group
    # in fp32 (CPU ranks), ZeRO-1 keeps only the reduced partition without accumulation
    fp32 = est("zero1", param_bytes=4, gradient_accumulation_steps=1)
    assert fp32.grads == 4 * P // 8
    assert est("zero1", param_bytes=4, gradient_accumulation_steps=4).grads == 4 * P


def test_fsdp_and_hsdp_sharding_degrees():
    full = est("fsdp_full_shard", 16)
    assert full.model_states == 16 * P // 16
    sgo = est("fsdp_shard_grad_op", 16)
    assert (sgo.params, sgo.grads, sgo.optimizer) == (4 * P // 16, 4 * P // 16, 8 * P // 16)
    assert sgo.buffers == 2 * P  # every unit stays gathered in bf16 until the end of backward
    hsdp = est("hsdp", 16, nodes=2)  # shards over the 8 GPUs of a node, replicates across the 2 nodes
    assert hsdp.model_states == 16 * P // 8


def test_offload_moves_states_to_host():
    z2 = est("zero2", offload="optimizer")
    assert (z2.params, z2.grads, z2.optimizer, z2.step) == (2 * P, 0, 0, 0)
    assert z2.cpu == P * (8 + 4 + 4) // 8  # fp32 momentum/variance + master + fp32 gradient partition per rank
    z3 = est("zero3", offload="optimizer+params")
    assert z3.model_states == 0
    assert z3.cpu == P * (8 + 4 + 4 + 2) // 8


@pytest.mark.parametrize(
    ("optimizer", "master", "bytes_per_param"),
    [("adamw", True, 8), ("adamw", False, 4), ("adamw_8bit", True, 2), ("sgd", True, 4), ("sgd", False, 2)],
)
def test_optimizer_state_bytes(optimizer, master, bytes_per_param):
    # torch optimizers keep state in the dtype of the weights they step: fp32 (mixed) or bf16 (pure)
    assert est("ddp", optimizer=optimizer, master_weights=master).optimizer == bytes_per_param * P


def test_totals_compose_allocated_reserved_and_context():
    m = est("ddp", 1)
    assert m.allocated == m.params + m.optimizer + m.buffers + max(m.activations + m.logits, m.grads + m.step)
    assert m.reserved == m.allocated + m.allocator and m.total == m.reserved + m.overhead
    assert m.overhead == CUDA_CONTEXT_BYTES  # one process, no NCCL communicator
    assert est("ddp", 8).overhead == CUDA_CONTEXT_BYTES + NCCL_BYTES
    assert est("zero2", 1).overhead == CUDA_CONTEXT_BYTES + NCCL_BYTES  # DeepSpeed creates them on one GPU too
    cpu = est("zero3", 2, device="cpu")
    assert cpu.overhead == 0 and cpu.allocator == 0


def test_activations_hand_computed_for_tiny_llama_fp32():
    spec = model_spec(tiny_llama_config())  # h=64, I=128, heads=4, kv=2, head_dim=16, vocab=256, 2 layers
    m = estimate_memory(spec, "ddp", 1, seq_len=64, micro_batch_size=2, param_bytes=4, device="cpu")
    # fp32, no autocast: each norm saves its input (4h) + normalised (4h) + output shared by consumers (4h);
    # attention q (4*64) + k, v (4*32 each) + out + contiguous (4*64 each) + lse (4*4); MLP 4 * 4 * 128
    norms = 2 * (12 * 64)
    attn = 4 * (3 * 64 + 2 * 32) + 4 * 4
    mlp = 4 * 4 * 128
    tokens = 128
    assert m.activations == 2 * (norms + attn + mlp) * tokens
    # logits: final norm (12h) + 3 fp32 [tokens, vocab] tensors in cross-entropy's backward
    assert m.logits == (12 * 64 + 3 * 4 * 256) * tokens
    ckpt = estimate_memory(
        spec, "ddp", 1, seq_len=64, micro_batch_size=2, param_bytes=4, device="cpu", activation_checkpointing=True
    )
    assert ckpt.activations == 2 * 64 * tokens * 4 + (norms + attn + mlp) * tokens  # layer inputs + one layer


def test_autocast_keeps_fp32_residual_and_casts_per_consumer():
    spec = model_spec(tiny_llama_config(num_hidden_layers=1))
    m = estimate_memory(spec, "ddp", 1, seq_len=10)
    # residual fp32: each norm saves 4h + 4h, then a bf16 cast per consumer (3 for attention, 2 for the MLP)
    norms = (8 * 64 + 3 * 2 * 64) + (8 * 64 + 2 * 2 * 64)
    attn = 2 * (3 * 64 + 2 * 32) + 4 * 4
    mlp = 4 * 2 * 128
    assert m.activations == (norms + attn + mlp) * 10


def test_liger_saves_less_and_drops_the_logits():
    spec = model_spec(tiny_llama_config(vocab_size=4096))
    kw = dict(seq_len=256, micro_batch_size=2)
    hf, liger = (estimate_memory(spec, "ddp", 1, use_liger_kernel=flag, **kw) for flag in (False, True))
    assert liger.activations < hf.activations  # RMSNorm saves only its input; SwiGLU recomputes silu
    assert liger.logits < hf.logits / 10  # no [tokens, vocab] fp32 tensors
    assert liger.total < hf.total


def test_eager_attention_keeps_the_score_matrix():
    spec = model_spec(tiny_llama_config(num_hidden_layers=1))
    sdpa = estimate_memory(spec, "ddp", 1, seq_len=100, master_weights=False)
    eager = estimate_memory(spec, "ddp", 1, seq_len=100, master_weights=False, attention="eager")
    # per token: fp32 softmax + bf16 copy per head per key ((4 + 2) * 4 heads * 100) instead of the lse (4 * 4)
    assert eager.activations - sdpa.activations == (6 * 4 * 100 - 4 * 4) * 100


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
    lora = estimate_memory(spec, "ddp", 1, method="lora", seq_len=1)
    assert lora.params == spec.num_params * 2 + t * 4  # 16-bit frozen base + fp32 adapters
    assert (lora.grads, lora.optimizer) == (t * 4, t * 8)
    q = estimate_memory(spec, "ddp", 1, method="qlora", seq_len=1)
    embeddings = 2 * 256 * 64  # embed_tokens + untied lm_head stay 16-bit
    base = (spec.num_params - embeddings) * QLORA_BASE_BYTES_PER_PARAM + embeddings * 2
    assert q.params == math.ceil(base + t * 4)
    assert abs(QLORA_BASE_BYTES_PER_PARAM - (0.5 + 0.127 / 8)) < 1e-3  # QLoRA paper: 0.127 bits of constants


def test_fsdp_buffers_root_unit_two_layers_and_reduce_input():
    spec = model_spec(tiny_llama_config())
    m = estimate_memory(spec, "fsdp_full_shard", 2, seq_len=1)
    # tail (lm_head 16384; the untied embedding is a unit of its own, resharded after forward) + 2 layers (2*36992)
    # in bf16; + one layer's fp32 reduce-scatter input
    assert m.buffers == (16384 + 2 * 36992) * 2 + 36992 * 4
    # accelerate <= 1.14 keeps the embedding in the root unit, gathered with lm_head
    old = estimate_memory(spec, "fsdp_full_shard", 2, seq_len=1, fsdp2_embedding_unit=False)
    assert old.buffers == (16384 * 2 + 2 * 36992) * 2 + 36992 * 4


def test_estimates_monotone_in_sharding():
    totals = [est(s).model_states for s in ("zero2", "zero3")]
    assert totals == sorted(totals, reverse=True)
    assert est("zero3", 64).total < est("zero3", 8).total
    assert est("fsdp_full_shard", 64).total < est("fsdp_full_shard", 8).total < est("ddp", 8).total


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
        ({"strategy": "fsdp_full_shard", "offload": "optimizer"}, "only ZeRO offloads the optimizer alone"),
        ({"param_bytes": 8}, "knows float32, bfloat16 and float16"),
        ({"param_bytes": 1}, "param_bytes must be 2"),
        ({"grad_bytes": 3}, "grad_bytes must be 2, 4 or None"),
        ({"attention": "flex"}, "unknown attention"),
        ({"device": "tpu"}, "unknown device"),
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
    kw = dict(seq_len=64, micro_batch_size=2, param_bytes=4, master_weights=False, device="cpu")
    one = estimate_memory(spec, "fsdp_full_shard", 2, **kw)
    assert one.activations + one.logits > one.grads
    # grads are created in backward as activations are freed: the peak holds the larger phase; the gathered
    # decoder units are free while the logits are alive (the loss comes after the last layer resharded); a layer's
    # backward holds its gathered units and the gradients it has in flight
    persistent = one.params + one.optimizer + one.buffers - one.unit_buffers
    assert one.total == persistent + one.activations + max(one.logits, one.unit_buffers + one.layer_grads)
    accum = estimate_memory(spec, "fsdp_full_shard", 2, gradient_accumulation_steps=4, **kw)
    # under the Trainer's no_sync FSDP2 keeps every unsharded gradient (fp32 here) through the next forward
    assert accum.grads == spec.num_params * 4
    assert accum.total == one.total + accum.grads


def test_lora_on_an_fp32_loaded_base_runs_under_autocast():
    spec = model_spec(tiny_llama_config())
    bf16 = estimate_memory(spec, "ddp", 1, method="lora", seq_len=8)
    fp32 = estimate_memory(spec, "ddp", 1, method="lora", seq_len=8, base_bytes=4)
    t = lora_trainable_params(spec, 16)
    assert fp32.params == spec.num_params * 4 + t * 4  # the frozen base as loaded
    assert fp32.buffers > 0 == bf16.buffers  # autocast's bf16 copies of the fp32 base weights
    # frozen linears save no input, so the fp32 residual stream adds little; the adapters save 16-bit casts
    assert fp32.allocated > bf16.allocated
    with pytest.raises(ValueError, match="base_bytes must be 2"):
        estimate_memory(spec, "ddp", 1, method="lora", base_bytes=8)


def test_fsdp2_checkpointing_per_child_saves_every_childs_input():
    """accelerate <= 1.14's fsdp2_apply_ac checkpoints each child of a decoder layer (norms, attention, MLP): each
    saves its hidden-sized input (traced: +1.5 GiB on Llama 3.2 1B at 8k tokens, 16 layers x 3 x 8192 x 2048 x 2 B)."""
    from hf_dist.testing import public_config

    kw = dict(world_size=8, seq_len=4096, micro_batch_size=2, activation_checkpointing=True, param_bytes=2)
    config = public_config("llama-3.2-1b")
    layer = estimate_memory(config, "fsdp_full_shard", **kw)
    children = estimate_memory(config, "fsdp_full_shard", checkpoint_children=True, **kw)
    assert children.activations - layer.activations == 16 * 3 * 8192 * 2048 * 2
    assert estimate_memory(config, "ddp", checkpoint_children=True, **kw) == estimate_memory(config, "ddp", **kw)


def test_a_layers_backward_holds_its_feed_forward_gradients():
    """down_proj's input gradient and the product's two: three I-sized tensors per token (one with Liger, whose
    SwiGLU backward writes into what it saved), plus the residual stream's gradient."""
    spec = model_spec(tiny_llama_config())
    kw = dict(seq_len=64, micro_batch_size=2, device="cpu")
    tokens, inter, hidden = 128, spec.intermediate_size, spec.hidden_size
    bf16 = estimate_memory(spec, "fsdp_full_shard", 2, **kw)  # bf16 compute, bf16 residual under FSDP2's policy
    assert bf16.layer_grads == tokens * (3 * 2 * inter + 2 * hidden)
    liger = estimate_memory(spec, "fsdp_full_shard", 2, use_liger_kernel=True, **kw)
    assert liger.layer_grads == tokens * (2 * inter + 2 * hidden)


def test_sync_each_batch_holds_sharded_gradients_and_reduce_scatters_every_micro_batch():
    """FSDP2 under the Trainer's no_sync keeps every unsharded fp32 gradient until the last micro-batch; with
    sync_each_batch each micro-batch reduce-scatters and only the rank's shard persists (accumulated in place)."""
    from hf_dist.planning.hardware import Hardware
    from hf_dist.planning.layout import strategy
    from hf_dist.planning.throughput import comm_seconds

    spec = model_spec(tiny_llama_config())
    kw = dict(seq_len=64, micro_batch_size=2, param_bytes=4, master_weights=False, device="cpu")
    no_sync = estimate_memory(spec, "fsdp_full_shard", 2, gradient_accumulation_steps=4, **kw)
    synced = estimate_memory(spec, "fsdp_full_shard", 2, gradient_accumulation_steps=4, sync_each_batch=True, **kw)
    assert no_sync.grads == spec.num_params * 4  # 4 fp32 bytes per parameter, unsharded
    assert synced.grads == math.ceil(spec.num_params * 4 / 2)  # the rank's half
    assert no_sync.total - synced.total == no_sync.grads - synced.grads  # alive through the next forward either way
    one = estimate_memory(spec, "fsdp_full_shard", 2, sync_each_batch=True, **kw)  # nothing accumulates: no change
    assert one == estimate_memory(spec, "fsdp_full_shard", 2, **kw)
    # communication per optimizer step of a 1B count on 8 ranks at 150 GB/s, accumulation 4, bf16 collectives:
    # two all-gathers of the parameters per micro-step either way; the reduce-scatter of the gradients once (no_sync)
    # or four times (sync_each_batch): 3 x 7/8 x 2e9 bytes / 150e9 B/s = 0.035 s more
    hw = Hardware(device="cuda", gpus_per_node=8, gpu_memory_gib=80, intra_node_gbps=150)
    s, f, count = strategy("fsdp_full_shard"), 7 / 8, model_spec(P)
    base = comm_seconds(s, "none", count, P, 8, 1, 4, 2, 2, hw)
    assert base == pytest.approx(2 * f * 2e9 * 4 / 150e9 + f * 2e9 / 150e9)
    assert comm_seconds(s, "none", count, P, 8, 1, 4, 2, 2, hw, sync_each_batch=True) - base == pytest.approx(0.035)
    # ZeRO-2/3 reduce-scatter every micro-step whatever the flag (the Trainer never runs DeepSpeed under no_sync)
    z3 = strategy("zero3")
    assert comm_seconds(z3, "none", count, P, 8, 1, 4, 2, 2, hw) == comm_seconds(
        z3, "none", count, P, 8, 1, 4, 2, 2, hw, True)  # fmt: skip
    with pytest.raises(ValueError, match=r"sync_each_batch with ddp: only FSDP2 keeps unsharded gradients"):
        estimate_memory(spec, "ddp", 2, sync_each_batch=True)


def test_the_reserve_is_the_compute_streams_and_the_collectives_streams():
    # FSDP2 full shard of 1B on 8 ranks: the compute stream keeps one block of the largest transient (a bare count has
    # none), the reduce-scatter stream the rank's fp32 gradient shard, 4 * P / 8 bytes
    m = est("fsdp_full_shard", 8)
    assert m.comm_reserve == 4 * P // 8 == m.allocator
    assert est("ddp", 8).comm_reserve == 0
    assert compute_stream_reserve_bytes(3 * GIB, 2 * GIB, ckpt=False) == 3 * GIB
    assert compute_stream_reserve_bytes(3 * GIB, 2 * GIB, ckpt=True) == 5 * GIB  # + the gradients between recomputes


def test_lora_fp32_adapters_under_autocast_copy_their_input_to_fp32():
    # PEFT's _cast_input_dtype: 4 bytes per input feature per token, the widest input (down_proj's: the MLP's width)
    assert lora_input_cast_bytes(16_384, (4096, 4096, 14_336), cast=True) == 4 * 16_384 * 14_336  # 896 MiB
    assert lora_input_cast_bytes(16_384, (4096, 14_336), cast=False) == 0
    spec = model_spec(tiny_llama_config())
    lora = estimate_memory(spec, "ddp", 1, method="lora", seq_len=64, micro_batch_size=4, use_liger_kernel=True)
    mlp = 2 * spec.intermediate_size * 64 * 4  # Liger drops the logits: the largest 16-bit transient is an MLP one
    assert lora.allocator == 4 * spec.intermediate_size * 64 * 4 == 2 * mlp


def test_zero3_gathers_its_largest_module_whole_past_the_live_limit():
    """ZeRO-3 fetches the module it runs whole: Mixtral's stacked experts (8 x 3 x 4096 x 14336) exceed
    stage3_max_live_parameters; Llama 3 8B's largest module, its 128k x 4096 head, does not. Mixtral's MoE block is a
    ZeRO-3 leaf (router and experts fetched as one), kept across the loss with the attention of its last layers."""
    from hf_dist.planning.layout import strategy
    from hf_dist.planning.moe import zero3_leaf_block_params
    from hf_dist.planning.transients import largest_module_params, zero3_gathered_bytes, zero3_reused_layers
    from hf_dist.testing import public_config

    mixtral, llama = model_spec(public_config("mixtral-8x7b")), model_spec(public_config("llama-3-8b"))
    assert largest_module_params(mixtral) == 8 * 3 * 4096 * 14336
    lay = engine_dtypes("zero3", 2, True, "full")
    zero3 = strategy("zero3")
    block = 8 * 4096 + 8 * 3 * 4096 * 14336  # router + experts
    assert zero3_leaf_block_params(mixtral) == block
    attention = mixtral.layer_params - block  # q, k, v, o and the two norms
    assert attention == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096
    for ckpt in (True, False):
        kept = zero3_reused_layers(mixtral, ckpt)
        assert zero3_gathered_bytes(mixtral, zero3, 64, lay, ckpt) == (block + kept * attention) * 2
    assert zero3_reused_layers(mixtral, True) == 6  # traced: layers 26-31's attention at the peak
    assert zero3_gathered_bytes(llama, zero3, 64, lay) == DS_MAX_LIVE_PARAMETERS * 2
    assert zero3_leaf_block_params(llama) == 0 and zero3_reused_layers(llama, True) == 0


def _reuse_scan_keeps(spec, ckpt: bool) -> int:
    """DeepSpeed 0.19.8's ``__params_to_release`` walked over the module trace of a step, as recorded for Mixtral
    (``model.layers.N``, its norms, ``self_attn``, q/k/v/o, then the leaf ``mlp``; final norm, ``lm_head``; in
    backward ``lm_head``, norm and, per layer from the last, its recompute then its backward): how many layers' q_proj,
    released after its forward, occurs again within ``stage3_max_reuse_distance`` elements. A leaf block's own
    parameters are its children's, so a scan for a module that is not a leaf counts it 0."""
    from hf_dist.planning.transients import DS_MAX_REUSE_DISTANCE

    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    layer = [("norm", h), ("q", h * h), ("k", h * kv), ("v", h * kv), ("o", h * h), ("norm", h), ("mlp", 0)]
    head = [("final_norm", h), ("lm_head", spec.lm_head_params)]
    trace = [((i, name), n) for i in range(spec.num_layers) for name, n in layer] + head + head[::-1]
    for i in reversed(range(spec.num_layers)):
        trace += [((i, name), n) for name, n in layer] * (2 if ckpt else 1)
    kept = 0
    for i in range(spec.num_layers):
        step = trace.index(((i, "q"), h * h)) + 1
        walked = 0
        for key, n in trace[step:]:
            if walked >= DS_MAX_REUSE_DISTANCE:
                break
            if key == (i, "q"):
                kept += 1
                break
            walked += n
    return kept


@pytest.mark.parametrize("ckpt", [True, False])
def test_zero3_reused_layers_follow_deepspeeds_reuse_scan(ckpt):
    from hf_dist.planning.transients import zero3_reused_layers
    from hf_dist.testing import public_config

    mixtral = model_spec(public_config("mixtral-8x7b"))
    assert zero3_reused_layers(mixtral, ckpt) == _reuse_scan_keeps(mixtral, ckpt)


def test_zero3_leaf_block_holds_its_expert_gradients_until_its_backward_ends():
    """stage3.py reduces a leaf module's gradients in its full backward hook: at the gate/up grouped_mm's backward
    every expert weight's gradient exists (traced on Mixtral 8x7B, 64 ranks, 8k tokens: gate/up 1.75 GiB, down
    0.875 GiB), with the gate/up output's gradient (0.875 GiB) and the input's (0.125 GiB) and the residual's."""
    from hf_dist.planning.activations import zero3_leaf_gradient_bytes
    from hf_dist.testing import public_config

    mixtral = model_spec(public_config("mixtral-8x7b"))
    lay = engine_dtypes("zero3", 2, True, "full")
    tokens, c, h, inter, k = 8192, 2, 4096, 14336, 2
    held = 3 * 8 * h * inter * c + k * (2 * c * inter + c * h) * tokens + c * h * tokens  # 3.6875 GiB traced
    freed = k * (4 * c * inter + c * h + 4 + 8) * tokens  # what the routed copies saved, gone by then
    assert zero3_leaf_gradient_bytes(mixtral, 8192, 1, lay) == held - freed
    assert held == int(3.6875 * GIB)
    kwargs = dict(seq_len=8192, activation_checkpointing=True)
    full = estimate_memory(mixtral, "zero3", 64, **kwargs)
    assert full.layer_grads == held - freed
    assert estimate_memory(mixtral, "zero3", 64, method="lora", **kwargs).layer_grads < held - freed  # frozen experts
    assert estimate_memory(mixtral, "fsdp_full_shard", 64, **kwargs).layer_grads < held - freed  # no leaf modules


def test_zero3_linear_saves_the_frozen_linears_inputs():
    """ZeRO-3's LinearFunctionForZeroStage3 saves its input whether or not the weight trains: a LoRA layer keeps the
    tensors its frozen linears read (traced on Mixtral LoRA: both norms' 16-bit outputs), unless an adapter without
    dropout already saves them."""
    from hf_dist.planning.activations import Lora, zero3_frozen_linear_bytes
    from hf_dist.testing import public_config

    mixtral, llama = model_spec(public_config("mixtral-8x7b")), model_spec(public_config("llama-3-8b"))
    lay = engine_dtypes("zero3", 2, True, "lora")
    adapters = (("q_proj", 4096, 16), ("k_proj", 4096, 16), ("v_proj", 4096, 16), ("o_proj", 4096, 16))
    assert zero3_frozen_linear_bytes(mixtral, lay, Lora(adapters, dropout=True)) == 2 * 2 * 4096  # router's input too
    assert zero3_frozen_linear_bytes(llama, lay, Lora(adapters, dropout=True)) == 2 * (2 * 4096 + 14336)
    # without dropout q/k/v's adapters save the first norm's output themselves
    assert zero3_frozen_linear_bytes(mixtral, lay, Lora(adapters, dropout=False)) == 2 * 4096
    kwargs = dict(method="lora", seq_len=4096, micro_batch_size=2, activation_checkpointing=True)
    zero3 = estimate_memory(mixtral, "zero3", 64, **kwargs)
    fsdp = estimate_memory(mixtral, "fsdp_full_shard", 64, **kwargs)
    assert zero3.recompute - fsdp.recompute == 2 * 2 * 4096 * 4096 * 2  # 128 MiB, the two traced tensors
