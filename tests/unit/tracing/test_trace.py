"""The tracer on tiny configs: every traceable layout runs, its model states equal hand-computed ones, and each
layout it cannot run is refused with the reason."""

from __future__ import annotations

import math
import warnings

import pytest
from transformers import LlamaConfig

from hf_dist.tracing import TraceError, TraceSetup, TraceTimeout, TraceUnsupported, trace_memory
from hf_dist.tracing.setup import LORA_TARGETS

H, INTER, LAYERS, HEADS, KV, VOCAB, SEQ, MB = 64, 128, 2, 4, 2, 256, 32, 2


def tiny(**overrides) -> LlamaConfig:
    kw = dict(hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              num_key_value_heads=KV, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False)  # fmt: skip
    return LlamaConfig(**{**kw, **overrides})


def shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, written out from the Llama architecture."""
    head = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    out = {"embed": (config.vocab_size, H), "norm": (H,)}
    if not config.tie_word_embeddings:
        out["lm_head"] = (config.vocab_size, H)
    for i in range(config.num_hidden_layers):
        out |= {f"{i}.q": (q, H), f"{i}.k": (kv, H), f"{i}.v": (kv, H), f"{i}.o": (H, q), f"{i}.gate": (INTER, H),
                f"{i}.up": (INTER, H), f"{i}.down": (H, INTER), f"{i}.in_norm": (H,), f"{i}.post_norm": (H,)}  # fmt: skip
    return out


def numel(config: LlamaConfig, shard: int = 1) -> int:
    """Elements on one rank; FSDP2 shards dim 0, padded to a multiple of the shard count (torch ``_chunk_with_empty``)."""
    return sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for s in shapes(config).values())


def adam_state(trainable: int, tensors: int, moment_bytes: int = 4) -> int:
    """Two moments per element, plus the fused AdamW's 0-d fp32 ``step`` per parameter tensor (torch/optim/adam.py)."""
    return 2 * moment_bytes * trainable + 4 * tensors


def trace(config=None, **setup):
    setup = {"seq_len": SEQ, "micro_batch_size": MB, **setup}
    return trace_memory(config or tiny(), isolate=False, **setup)


def test_ddp_one_process_states_are_fp32_masters_and_adam_moments():
    result = trace(strategy="ddp")
    n = numel(tiny())
    assert result.states == {"params": 4 * n, "optimizer": adam_state(n, len(shapes(tiny())))}
    assert result.complete and result.peak_phase in ("forward", "backward", "optimizer step")
    assert result.peak_bytes >= result.states["params"] + result.states["optimizer"]
    assert sum(result.terms.values()) == result.peak_bytes


def test_ddp_replicas_add_the_reducer_buckets():
    one, four = trace(strategy="ddp"), trace(strategy="ddp", world_size=4)
    n = numel(tiny())
    assert four.states == one.states  # DDP replicates the model states
    assert four.categories["Other"] == 4 * n  # one fp32 copy of every gradient, counted in buffers
    assert "Other" not in one.categories and any("Reducer" in note for note in four.notes)
    assert four.terms["buffers"] == one.terms["buffers"] + 4 * n


@pytest.mark.parametrize(("strategy", "world", "nodes", "shard"), [
    ("fsdp_full_shard", 8, 1, 8), ("fsdp_shard_grad_op", 8, 1, 8), ("hsdp", 16, 2, 8), ("fsdp_full_shard", 3, 1, 3),
])  # fmt: skip
def test_fsdp2_states_are_the_rank_shards(strategy, world, nodes, shard):
    result = trace(strategy=strategy, world_size=world, nodes=nodes)
    n = numel(tiny(), shard)
    assert result.states == {"params": 4 * n, "optimizer": adam_state(n, len(shapes(tiny())))}
    assert result.terms["buffers"] > 0  # gathered bf16 units


def test_shard_grad_op_keeps_gathered_units_longer_than_full_shard():
    full = trace(strategy="fsdp_full_shard", world_size=8)
    grad_op = trace(strategy="fsdp_shard_grad_op", world_size=8)
    assert grad_op.terms["buffers"] > full.terms["buffers"]


def test_pure_bf16_halves_weights_and_adam_state():
    result = trace(strategy="ddp", pure_bf16=True)
    n = numel(tiny())
    assert result.states == {"params": 2 * n, "optimizer": adam_state(n, len(shapes(tiny())), moment_bytes=2)}


def test_lora_trains_only_the_adapters_on_a_16bit_base():
    rank = 4
    result = trace(strategy="ddp", method="lora", lora_rank=rank)
    s = shapes(tiny())
    adapted = [shape for name, shape in s.items() if name.split(".")[-1] + "_proj" in LORA_TARGETS]
    adapters = sum(rank * (out + inp) for out, inp in adapted)  # A: rank x in, B: out x rank
    assert len(adapted) == 7 * LAYERS
    assert result.states == {
        "params": 2 * numel(tiny()) + 4 * adapters,
        "optimizer": adam_state(adapters, 2 * len(adapted)),
    }


def test_lora_dropout_keeps_more_activations_than_none():
    with_dropout = trace(strategy="ddp", method="lora", lora_dropout=0.1)
    without = trace(strategy="ddp", method="lora", lora_dropout=0.0)
    assert with_dropout.terms["activations"] > without.terms["activations"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp_full_shard"])
def test_dropout_adds_what_the_memory_model_says(strategy):
    """lora_dropout 0 vs 0.05: traced and modelled peaks move by the same bytes. DDP: the fp32 adapters copy their
    input either way, so only the masks: 2 layers x 512 bytes per token, less layer 0's q/k/v (their input, the
    frozen embedding's output, needs no gradient). FSDP2 (bf16 adapters): + each adapter's own dropped copy where
    q/k/v, gate/up and o_proj (with the attention output) shared one tensor: 2 x 4 x 64 x 2 bytes per token."""
    from hf_dist.planning.memory import estimate_memory

    config = tiny(vocab_size=4096)  # the loss's logits make the peak: every activation is alive
    world = 1 if strategy == "ddp" else 2
    traced, modelled = [], []
    for dropout in (0.0, 0.05):
        result = trace(config, strategy=strategy, world_size=world, method="lora", lora_dropout=dropout)
        traced.append(result.peak_bytes)
        modelled.append(estimate_memory(config, strategy, **result.setup.estimate_kwargs()).allocated)
    tokens, masks = SEQ * MB, 2 * 512 - 3 * 64
    copies = 0 if strategy == "ddp" else 2 * 4 * 64 * 2
    assert traced[1] - traced[0] == modelled[1] - modelled[0] == (masks + copies) * tokens


def test_a_peft_models_own_lora_is_traced_with_its_plan():
    """trace_memory(peft_model, plan) applies the model's LoRA (rank 64 on q/v, dropout 0), not the recipes'."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.planning.planner import plan

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(tiny()).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=64, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    p = plan(model, gpus=1, gpu_memory_gib=80, seq_len=SEQ, micro_batch_size=MB)
    result = trace_memory(model, p, isolate=False)
    assert result.setup.lora == p.lora and p.lora.rank == 64 and p.lora.dropout == 0.0
    s = shapes(tiny())
    adapters = sum(64 * sum(shape) for name, shape in s.items() if name.split(".")[-1] in ("q", "v"))
    assert adapters == p.trainable_params == sum(x.numel() for x in model.parameters() if x.requires_grad)
    assert result.states == {"params": 2 * numel(tiny()) + 4 * adapters,
                             "optimizer": adam_state(adapters, 2 * 2 * LAYERS)}  # fmt: skip
    other = plan(tiny(), method="lora", gpus=1, gpu_memory_gib=80, seq_len=SEQ, micro_batch_size=MB)
    with pytest.raises(ValueError, match=r"the PeftModel's LoRA \(r=64.*\) is not the plan's \(r=16"):
        trace_memory(model, other, isolate=False)
    with pytest.raises(ValueError, match=r"target_modules name 'qkv' matches no module"):
        trace(strategy="ddp", lora_targets=["qkv"])


def test_sync_each_batch_holds_only_the_sharded_gradients_as_modelled():
    """Llama 3.2 1B, FSDP2 full-shard on 8 ranks, accumulation 2: the Trainer's no_sync keeps every unsharded fp32
    gradient through the next micro-batch (FSDPMemTracker files them as temporaries); with sync_each_batch each
    micro-batch reduce-scatters and only the rank's shards persist. The tracer runs the Trainer's sync (no
    ``set_requires_gradient_sync(False)``); traced and modelled agree within the trace-accuracy matrix's 5 %, and
    move by the same bytes."""
    from hf_dist.planning.memory import estimate_memory
    from hf_dist.testing import public_config

    config = public_config("llama-3.2-1b")
    kw = dict(strategy="fsdp_full_shard", world_size=8, gradient_accumulation_steps=2, seq_len=1024)
    traced, modelled = [], []
    for sync in (False, True):
        result = trace_memory(config, isolate=False, micro_batch_size=1, sync_each_batch=sync, **kw)
        traced.append(result.peak_bytes)
        modelled.append(estimate_memory(config, "fsdp_full_shard", **result.setup.estimate_kwargs()).allocated)
        assert abs(modelled[-1] / traced[-1] - 1) < 0.05
    assert result.terms["grads"] == result.states["params"]  # fp32 gradient shards, the size of the fp32 masters
    assert abs((traced[0] - traced[1]) / (modelled[0] - modelled[1]) - 1) < 0.01
    with pytest.raises(ValueError, match="sync_each_batch with ddp"):
        trace(strategy="ddp", gradient_accumulation_steps=2, sync_each_batch=True)


def test_checkpointing_and_accumulation_change_the_peak_as_the_engines_do():
    plain = trace(strategy="ddp")
    assert trace(strategy="ddp", activation_checkpointing=True).terms["activations"] < plain.terms["activations"]
    accumulated = trace(strategy="fsdp_full_shard", world_size=2, gradient_accumulation_steps=4)
    assert accumulated.peak_bytes > trace(strategy="fsdp_full_shard", world_size=2).peak_bytes  # grads kept across


def test_tensor_parallel_rank_holds_the_analytic_tp_shard():
    from hf_dist.planning.layout import Layout
    from hf_dist.planning.modelinfo import model_spec
    from hf_dist.tracing.setup import _transformers_distributes_meta_models

    if not _transformers_distributes_meta_models():  # older transformers: refused, naming what is missing
        with pytest.raises(TraceUnsupported, match="maybe_distribute_model, transformers >= 5.23"):
            trace(strategy="ddp", world_size=2, tp_size=2)
        return
    result = trace(strategy="ddp", world_size=2, tp_size=2)
    spec = Layout("ddp", 2, tp_size=2).rank_spec(model_spec(tiny()))
    assert result.states["params"] == 4 * spec.num_params
    fsdp_tp = trace(strategy="fsdp_full_shard", world_size=8, tp_size=2)
    assert fsdp_tp.states["params"] < result.states["params"]


def test_fsdp2_x_tp_traces_with_the_runs_mixed_precision_policy():
    """The run's FSDP2 gathers bf16 weights (accelerate's MixedPrecisionPolicy); traced with fp32 gathered weights,
    autocast would cache a bf16 copy of every layer's weights until the loss: 0.72 of the trace was modelled then."""
    from transformers import LlamaConfig

    from hf_dist.planning.memory import estimate_memory
    from hf_dist.tracing import TraceSetup
    from hf_dist.tracing.setup import _transformers_distributes_meta_models

    if not _transformers_distributes_meta_models():
        pytest.skip("FSDP2 x TP needs transformers >= 5.23 here (refused below it: the test above)")
    weighty = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    setup = dict(strategy="fsdp_full_shard", world_size=8, tp_size=2, seq_len=16, micro_batch_size=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        traced = trace_memory(weighty, isolate=False, mixed_precision="bf16", **setup)
    assert not [w for w in said if "returned a view tensor" in str(w.message)]  # FSDP2's warning: noise in a trace
    modelled = estimate_memory(weighty, "fsdp_full_shard", **TraceSetup(**setup).estimate_kwargs())
    assert modelled.allocated / traced.peak_bytes == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("setup", [
    {"strategy": "ddp"}, {"strategy": "ddp", "world_size": 4, "activation_checkpointing": True},
    {"strategy": "ddp", "method": "lora", "lora_dropout": 0.1, "gradient_accumulation_steps": 2},
    {"strategy": "ddp", "pure_bf16": True, "use_liger_kernel": True},
    {"strategy": "fsdp_full_shard", "world_size": 4, "gradient_accumulation_steps": 4},
    {"strategy": "fsdp_shard_grad_op", "world_size": 4, "method": "lora", "activation_checkpointing": True},
    {"strategy": "hsdp", "world_size": 8, "nodes": 2, "use_liger_kernel": True},
])  # fmt: skip
def test_optimizer_state_made_directly_traces_what_a_first_step_leaves(monkeypatch, setup):
    """The trace makes the optimizer state directly instead of running a first step (half the trace's time): the
    peak, its terms and phase, and the states after the step are the same."""
    import hf_dist.tracing.trace as trace_module

    direct = trace(**setup)
    monkeypatch.setattr(trace_module, "WARM_UP_BY_STEP", True)
    stepped = trace(**setup)
    assert (direct.peak_bytes, direct.terms, direct.peak_phase, direct.states) == (
        stepped.peak_bytes, stepped.terms, stepped.peak_phase, stepped.states)  # fmt: skip


def test_isolated_trace_equals_the_in_process_one():
    isolated = trace_memory(tiny(), isolate=True, strategy="fsdp_full_shard", world_size=4, seq_len=SEQ,
                            micro_batch_size=MB)  # fmt: skip
    here = trace(strategy="fsdp_full_shard", world_size=4)
    assert (isolated.peak_bytes, isolated.states, isolated.terms) == (here.peak_bytes, here.states, here.terms)


# ---------------------------------------------------------------- what cannot be traced, and bad input


@pytest.mark.parametrize(("setup", "named"), [
    ({"strategy": "zero3", "world_size": 8, "mixed_precision": "fp16"}, "DeepSpeed fp16: its loss scaler"),
    ({"strategy": "zero2", "world_size": 8, "tp_size": 2}, "DeepSpeed AutoTP"),
    ({"strategy": "ddp", "world_size": 2, "tp_size": 2, "use_liger_kernel": True}, "Liger kernels with tensor"),
    ({"strategy": "ddp", "method": "qlora"}, "bitsandbytes"),
    ({"strategy": "zero2", "world_size": 8, "offload": "optimizer"}, "CPU offload"),
    ({"strategy": "fsdp_full_shard", "world_size": 8, "offload": "optimizer+params"}, "CPU offload"),
    ({"strategy": "fsdp_full_shard", "world_size": 8, "cp_size": 2}, "context parallelism"),
])  # fmt: skip
def test_untraceable_layouts_say_why_and_that_the_estimate_stands(setup, named):
    with pytest.raises(TraceUnsupported, match=rf"cannot trace .*{named}.*the analytic estimate stands"):
        trace(**setup)


def test_unbuildable_config_is_one_line():
    bad = {k: v for k, v in tiny().to_dict().items() if k != "head_dim"} | {"num_attention_heads": 3}
    bad["num_key_value_heads"] = 1  # (transformers >= 5.x validates the config itself; 5.0 leaves it to hf_dist)
    with pytest.raises(ValueError, match=r"not a multiple .*fix config.json") as info:
        trace(bad, strategy="ddp")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="model_type"):
        trace_memory({"hidden_size": 8}, strategy="ddp")


def test_world_size_the_mesh_cannot_take():
    with pytest.raises(ValueError, match="nodes") as info:
        TraceSetup(strategy="hsdp", world_size=6, nodes=4)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="world_size"):
        TraceSetup(strategy="ddp", world_size=0)


def test_time_limit_reports_the_partial_peak_and_never_hangs():
    with pytest.raises(TraceTimeout, match=r"ran past its 0.01 s limit .*the analytic estimate stands") as info:
        trace(strategy="ddp", time_limit_s=0.01)
    assert info.value.partial is not None and not info.value.partial.complete


def test_a_model_that_fails_under_the_layout_is_a_trace_error():
    """Mixtral's experts under DDP with fp32 master weights: transformers' grouped_mm path hands fp32 operands to
    ``_grouped_mm``, whose kernel checks want bf16 (transformers 5.0's per-expert loop fails on data-dependent
    shapes instead); either way the trace names the layout and the failure instead of a number."""
    from transformers import MixtralConfig

    moe = MixtralConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=HEADS,
                        num_key_value_heads=KV, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip
    with pytest.raises(TraceError, match=r"the model failed under ddp x 1 ranks, bf16 .*analytic estimate stands"):
        trace(moe, strategy="ddp")


def test_the_embedding_unit_feature_says_what_accelerate_does():
    """``LibraryFeatures.fsdp2_embedding_unit`` (read from accelerate's source) against what its
    ``fsdp2_prepare_model`` really does to an untied input embedding, on a fake world of 2 ranks."""
    from torch.distributed.fsdp import FSDPModule

    from hf_dist.planning.features import installed_features
    from hf_dist.tracing.prepare import build_model, shard
    from hf_dist.tracing.trace import fake_world

    setup = TraceSetup(strategy="fsdp_full_shard", world_size=2, seq_len=16)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)  # fmt: skip
    with fake_world(setup) as mesh:
        model = shard(build_model(config, setup), setup, mesh)
        alone = isinstance(model.get_input_embeddings(), FSDPModule)
    assert alone == installed_features().fsdp2_embedding_unit
