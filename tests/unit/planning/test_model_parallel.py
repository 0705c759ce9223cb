"""Tensor / context / sequence parallelism and NVMe offload in the memory model, the throughput model and the
planner's search (configs only: nothing is allocated). What a TP rank really holds is checked against a real run
in tests/distributed/test_tensor_parallel.py."""

import dataclasses
import math
import re

import pytest
from transformers import GPT2Config

from hf_dist.planning.dtypes import GIB
from hf_dist.planning.features import LibraryFeatures, installed_features
from hf_dist.planning.hardware import detect_hardware
from hf_dist.planning.layout import Layout
from hf_dist.planning.memory import estimate_memory
from hf_dist.planning.modelinfo import model_spec
from hf_dist.planning.planner import PlanError, plan
from hf_dist.planning.throughput import model_parallel_seconds, nvme_seconds
from hf_dist.testing import llama3_config, tiny_llama_config

LLAMA_8B = llama3_config("Llama-3-8B")
LLAMA_70B = llama3_config("Llama-3-70B")
# the long-context shapes: Llama 3.1 scales RoPE to 131072 positions (Llama 3 has 8192, and longer is refused)
LLAMA31_8B = llama3_config("Llama-3.1-8B")
LLAMA31_70B = llama3_config("Llama-3.1-70B")
ALL = LibraryFeatures()


# ---------------------------------------------------------------- memory per dimension


def test_tp_shard_splits_every_weight_but_the_norms():
    spec = model_spec(LLAMA_8B)
    local = spec.tensor_parallel_shard(2)
    norms = spec.num_layers * spec.norms_per_layer * spec.hidden_size + spec.hidden_size
    assert 2 * local.num_params == spec.num_params + norms
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (16, 4, 7168)
    assert local.vocab_size == spec.vocab_size  # lm_head gathers its output: the logits stay whole
    assert spec.tensor_parallel_shard(1) is spec
    with pytest.raises(ValueError, match="needs the model's shape"):
        model_spec(8_000_000_000).tensor_parallel_shard(2)


def test_tp_divides_model_states_and_head_activations_not_logits():
    base = estimate_memory(LLAMA_8B, "ddp", 2, tp_size=1, seq_len=4096)
    tp = estimate_memory(LLAMA_8B, "ddp", 2, tp_size=2, seq_len=4096)
    local = model_spec(LLAMA_8B).tensor_parallel_shard(2)
    assert tp.params == local.num_params * 4  # fp32 weights under autocast, nothing replicated: dp = 1
    assert tp.logits == base.logits
    assert base.activations / 2 < tp.activations < base.activations  # norms and residual stay replicated


@pytest.mark.parametrize("dim", ["cp_size", "sp_size"])
def test_sequence_split_divides_activations_and_logits(dim):
    strategy = "fsdp_full_shard" if dim == "cp_size" else "zero3"
    split = estimate_memory(LLAMA_8B, strategy, 8, seq_len=32768, **{dim: 4})
    short = estimate_memory(LLAMA_8B, strategy, 8, seq_len=8192)
    assert (split.activations, split.logits) == (short.activations, short.logits)
    # the states are sharded over the whole group (FSDP2: dp_shard x cp; ZeRO: dp x sp)
    assert split.optimizer == short.optimizer


def test_eager_attention_under_sp_attends_over_the_whole_sequence():
    split = estimate_memory(LLAMA_8B, "zero3", 8, seq_len=8192, sp_size=4, attention="eager")
    short = estimate_memory(LLAMA_8B, "zero3", 8, seq_len=2048, attention="eager")
    assert split.activations > short.activations


def test_nvme_offload_keeps_gpu_side_and_counts_pinned_buffers():
    from hf_dist.planning.model_states import trainable_tensors

    cpu = estimate_memory(LLAMA_70B, "zero3", 8, offload="optimizer+params")
    nvme = estimate_memory(LLAMA_70B, "zero3", 8, offload="optimizer+params", offload_device="nvme")
    assert dataclasses.replace(nvme, cpu=0, swap=0) == dataclasses.replace(cpu, cpu=0)
    partition = math.ceil(model_spec(LLAMA_70B).num_params / 8)
    # swap files: fp32 master and two fp32 Adam moments, the fp32 gradients and bf16 parameters of every tensor but
    # the norms (each partition is far over DeepSpeed's 1 MiB threshold)
    tensors = sum(math.ceil(n / 8) for n in trainable_tensors(model_spec(LLAMA_70B)))
    assert nvme.swap == partition * 12 + tensors * (4 + 2) and cpu.swap == 0
    assert 0.999 * partition < tensors < partition
    # fp32 gradient partition + 4 optimizer swap buffers of 1e8 fp32 + 5 bf16 param buffers of the largest partition
    # (the 128256 x 8192 embedding over 8 ranks, over the 1e8 default) + 1e9 bf16 in CPU
    assert nvme.cpu == partition * 4 + 4 * 10**8 * 4 + (5 * math.ceil(128256 * 8192 / 8) + 10**9) * 2
    assert nvme.cpu < cpu.cpu / 3


def test_hsdp_needs_whole_replicas_per_node():
    with pytest.raises(ValueError, match="data-parallel size .* = 1 is not a multiple of the 2 nodes"):
        Layout("hsdp", 16, 2, cp_size=16)


# ---------------------------------------------------------------- throughput


def test_model_parallel_traffic():
    hw = detect_hardware(gpus=8, gpu_memory_gib=80)
    spec = model_spec(LLAMA_8B)
    assert model_parallel_seconds(Layout("fsdp_full_shard", 8), spec, 4096, 1, hw, False) == 0
    tp2 = model_parallel_seconds(Layout("fsdp_full_shard", 8, tp_size=2), spec, 4096, 1, hw, False)
    tp8 = model_parallel_seconds(Layout("fsdp_full_shard", 8, tp_size=8), spec, 4096, 1, hw, False)
    assert 0 < tp2 < tp8
    recompute = model_parallel_seconds(Layout("fsdp_full_shard", 8, tp_size=2), spec, 4096, 1, hw, True)
    assert recompute > tp2
    slow = detect_hardware(gpus=8, gpu_memory_gib=80, nvme_gbps=3)
    fast = detect_hardware(gpus=8, gpu_memory_gib=80, nvme_gbps=12)
    assert nvme_seconds(spec, spec.num_params, "optimizer", 1, 2, slow) == pytest.approx(
        4 * nvme_seconds(spec, spec.num_params, "optimizer", 1, 2, fast)
    )


# ---------------------------------------------------------------- the planner's search


def test_data_parallel_first():
    p = plan(LLAMA_8B, gpus=8, gpu_memory_gib=80, global_batch_size=64, features=ALL)
    assert (p.tp_size, p.cp_size, p.sp_size, p.offload_device) == (1, 1, 1, "cpu")
    assert "tp/cp/sp not searched: a data-parallel layout fits without offload" in p.explain()


def test_long_context_splits_the_sequence():
    p = plan(LLAMA31_8B, gpus=8, gpu_memory_gib=80, seq_len=131072, global_batch_size=8, features=ALL)
    assert p.cp_size * p.sp_size > 1 and p.memory.total <= p.usable_gib * GIB
    assert p.layout.seq_shards == p.cp_size * p.sp_size
    assert p.micro_batch_size * p.gradient_accumulation_steps * p.layout.dp_size == 8
    assert "parallelism: searched" in p.explain()


def test_global_batch_smaller_than_the_gpus():
    p = plan(LLAMA_70B, gpus=64, nodes=8, gpu_memory_gib=80, global_batch_size=16, features=ALL)
    assert p.layout.dp_size <= 16 and p.tp_size * p.cp_size * p.sp_size > 1
    assert p.micro_batch_size * p.gradient_accumulation_steps * p.layout.dp_size == 16
    assert p.tp_size <= 8  # inside a node
    assert "tp=8 because the global batch (16) is smaller than the 64 GPUs" in p.reason
    assert "layouts) because the global batch (16) is smaller than the 64 GPUs" in p.explain()


def test_a_global_batch_the_ranks_do_not_divide_is_refused_not_split():
    """12 sequences on 8 GPUs: a data-parallel layout fits at 8 or 16, so splitting the model (cp=2 here before)
    would be a choice the user never made; asked for (pinned sizes) or needed by memory, it stands and says why."""
    tiny = tiny_llama_config()
    with pytest.raises(ValueError) as refused:
        plan(tiny, gpus=8, gpu_memory_gib=80, global_batch_size=12, features=ALL)
    assert str(refused.value) == (
        "global_batch_size 12 is not divisible by the 8 data-parallel ranks (12 = 1 x 8 + 4), and a data-parallel "
        "layout fits without splitting the model; use global_batch_size 8 or 16 (a multiple of 8), or pin tp_size / "
        "cp_size / sp_size to split the model instead"
    )
    with pytest.raises(ValueError, match=r"by micro_batch_size 4 x 8 data-parallel ranks = 32 \(12 = 0 x 32 \+ 12\).*"
                       r"use global_batch_size 32 \(a multiple of 32\)"):  # fmt: skip
        plan(tiny, gpus=8, gpu_memory_gib=80, global_batch_size=12, micro_batch_size=4, features=ALL)
    pinned = plan(tiny, gpus=8, gpu_memory_gib=80, global_batch_size=12, tp_size=2, features=ALL)
    assert (pinned.tp_size, pinned.layout.dp_size) == (2, 4) and "tp=2 as asked" in pinned.reason
    # memory: 128k tokens fit no data-parallel layout even at 8 sequences, so the split stands, and says so
    long = plan(LLAMA31_8B, gpus=8, gpu_memory_gib=80, seq_len=131072, global_batch_size=12, features=ALL)
    assert long.cp_size * long.sp_size > 1 and long.layout.dp_size in (1, 2, 4)
    assert "because no data-parallel layout fits without offload, even at global batch 8, and 12 is not divisible by 8" in (
        long.reason)  # fmt: skip


def test_cpu_ranks_never_get_context_parallelism():
    p = plan(LLAMA31_8B, hardware=detect_hardware(gpus=8, gpu_memory_gib=80), seq_len=131072, global_batch_size=8,
             features=ALL)  # fmt: skip
    assert p.cp_size > 1 or p.sp_size > 1
    cpu = detect_hardware(gpus=2)
    with pytest.raises(ValueError, match="cp_size 2 cannot run here: CPU ranks"):
        plan(LLAMA_8B, hardware=cpu, cp_size=2, features=ALL)


def test_versions_without_a_dimension_are_never_proposed():
    old = LibraryFeatures(sequence_parallel=False, parallelism_config=False)
    # 128k tokens need the sequence split (the fp32 logits alone are 192 GiB): without it nothing fits, and says why
    with pytest.raises(PlanError, match="(?s)sp: needs accelerate >= 1.12 .*searched nothing"):
        plan(LLAMA31_8B, gpus=8, gpu_memory_gib=80, seq_len=131072, global_batch_size=8, features=old)
    p = plan(LLAMA_70B, gpus=64, nodes=8, gpu_memory_gib=80, global_batch_size=64, features=old)
    assert (p.tp_size, p.cp_size, p.sp_size) == (1, 1, 1)
    with pytest.raises(ValueError, match="sp_size 2 cannot run here: needs accelerate >= 1.12"):
        plan(LLAMA_8B, gpus=8, gpu_memory_gib=80, sp_size=2, features=old)


def test_pinned_sizes_and_bad_sizes():
    p = plan(LLAMA_8B, gpus=8, gpu_memory_gib=80, tp_size=2, features=ALL)
    assert p.tp_size == 2 and all(c.tp_size == 2 for c in p.candidates)
    with pytest.raises(ValueError, match="no layout runs tp_size=16"):
        plan(LLAMA_8B, gpus=16, nodes=2, gpu_memory_gib=80, tp_size=16, features=ALL)  # across nodes
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        plan(LLAMA_8B, gpus=8, gpu_memory_gib=80, tp_size=0)
    with pytest.raises(ValueError, match="tp_size 3 does not divide the model's 32 attention heads"):
        estimate_memory(LLAMA_8B, "fsdp_full_shard", 6, tp_size=3)


def test_deepspeed_autotp_is_searched_only_where_deepspeed_has_it():
    """70B on 8 nodes at global batch 16 must split the batch: AutoTP (zero1/zero2 x tp) is among the layouts searched
    when the installed DeepSpeed trains AutoTP, never otherwise, and never together with Ulysses SP."""
    kw = dict(gpus=64, nodes=8, gpu_memory_gib=80, global_batch_size=16)
    autotp = [c for c in plan(LLAMA_70B, **kw, features=ALL).candidates if c.tp_size > 1 and c.strategy != "ddp"]
    assert {c.strategy for c in autotp} >= {"zero1", "zero2", "fsdp_full_shard"}
    assert not [c for c in autotp if c.sp_size > 1]  # AutoTP x Ulysses does not run (Layout refuses it)
    old = dataclasses.replace(ALL, deepspeed_autotp=False)
    searched = plan(LLAMA_70B, **kw, features=old).candidates
    assert not [c for c in searched if c.tp_size > 1 and c.strategy.startswith("zero")]
    assert [c for c in searched if c.tp_size > 1 and c.strategy == "fsdp_full_shard"]
    with pytest.raises(
        ValueError, match=r"tp_size 2 with zero2 needs DeepSpeed AutoTP training .*deepspeed >= 0\.16\.4"
    ):
        plan(LLAMA_8B, gpus=8, gpu_memory_gib=80, strategy="zero2", tp_size=2, features=old)


def test_tp_needs_a_tensor_parallel_plan():
    gpt2 = GPT2Config(n_embd=256, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match="tp_size 2 cannot run here: the model's config has no tensor-parallel plan"):
        plan(gpt2, gpus=2, gpu_memory_gib=80, tp_size=2, features=ALL)


def test_long_context_on_one_node_offloads_with_sequence_parallelism():
    """70B at 64k tokens on 8 x 80 GB: no layout fits without offload, and CPU offload fits only with the sequence
    split too (ZeRO-3 + offload + Ulysses SP, DeepSpeed ALST's recipe); its configs carry both."""
    from hf_dist.configs.training_args import strategy_args

    kw = dict(gpus=8, gpu_memory_gib=80, host_memory_gib=4096, seq_len=65536, global_batch_size=8, features=ALL)
    p = plan(LLAMA31_70B, **kw)
    assert (p.strategy, p.sp_size > 1, p.offload != "none", p.offload_device) == ("zero3", True, True, "cpu")
    assert not [c for c in p.candidates if c.fits and c.offload == "none"]
    assert not [c for c in p.candidates if c.fits and c.model_parallel == 1]  # DP + offload alone does not fit
    assert "searched sp with ZeRO CPU offload" in p.explain()
    ds = strategy_args(p.layout)["deepspeed"]
    assert (
        ds["sequence_parallel_size"] == p.sp_size and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    )


def test_nvme_when_host_ram_is_too_small_for_cpu_offload():
    kw = dict(gpus=8, gpu_memory_gib=80, host_memory_gib=512, global_batch_size=16, features=ALL)
    with pytest.raises(PlanError, match="nvme: not searched: pass nvme_gbps"):
        plan(LLAMA_70B, **kw)
    p = plan(LLAMA_70B, nvme_gbps=12, **kw)
    assert p.offload_device == "nvme" and p.strategy == "zero3" and p.offload != "none"
    assert p.layout.offload_device == "nvme" and p.memory.cpu * 8 <= 512 * GIB
    assert "to NVMe (ZeRO-Infinity) because nothing fits without it" in p.reason


def test_plan_layout_reaches_the_configs():
    from hf_dist.configs.training_args import from_pretrained_kwargs, strategy_args

    p = plan(LLAMA_8B, gpus=8, gpu_memory_gib=80, tp_size=2, strategy="fsdp_full_shard", features=ALL)
    out = strategy_args(p.layout, wrap_classes=["LlamaDecoderLayer"])
    load = from_pretrained_kwargs(p.layout)["distributed_config"]
    assert out["parallelism_config"]["tp_size"] == load["tp_size"] == 2
    assert out["parallelism_config"]["dp_shard_size"] == load["fsdp_size"] == 4
    assert p.to_dict()["tp_size"] == 2


def test_one_gpu_is_named_as_the_reason_a_dimension_cannot_run():
    """2 divides the 32 heads and 2048 tokens: what rules sp/cp/tp out on one GPU is the one GPU."""
    one = dict(gpus=1, gpu_memory_gib=80, features=ALL)
    with pytest.raises(ValueError, match="sp_size 2 cannot run here: one GPU in the job"):
        plan(LLAMA_8B, sp_size=2, seq_len=2048, **one)
    with pytest.raises(ValueError, match="cp_size 2 cannot run here: one GPU in the job"):
        plan(LLAMA_8B, cp_size=2, seq_len=2048, hardware=detect_hardware(gpus=1, gpu_memory_gib=80), features=ALL)
    with pytest.raises(ValueError, match="tp_size 2 cannot run here: one GPU per node"):
        plan(LLAMA_8B, tp_size=2, **one)
    with pytest.raises(ValueError, match="sp_size 2 cannot run here: no size > 1 divides the 32 attention heads"):
        plan(LLAMA_8B, sp_size=2, seq_len=2047, gpus=2, gpu_memory_gib=80, features=ALL)


def test_lora_is_never_planned_with_tensor_parallelism():
    """PEFT's LoRA layers crash on TP-sharded weights: never searched, and a pinned tp_size is refused before any model
    is built, naming what to do instead."""
    p = plan(LLAMA_70B, gpus=8, gpu_memory_gib=80, method="lora", features=ALL)
    assert all(c.tp_size == 1 for c in p.candidates) and "PEFT's LoRA layers" in " ".join(p.dimensions)
    with pytest.raises(ValueError, match=r"tp_size 2 cannot run here: lora: PEFT's LoRA layers do not run on "
                       r"tensor-parallel weights; shard the frozen base with fsdp_full_shard"):  # fmt: skip
        plan(LLAMA_8B, gpus=8, gpu_memory_gib=80, tp_size=2, method="lora", features=ALL)


def test_a_faster_layout_just_over_the_margin_is_named_with_the_margin_that_takes_it():
    # without sync_each_batch: with it, FSDP2 shard-grad-op fits the tighter margin faster than the near miss
    # (test_planner.py::test_sync_each_batch_is_chosen_when_it_makes_a_faster_layout_fit)
    kw = dict(gpus=8, gpu_memory_gib=80, global_batch_size=64, micro_batch_size=4, features=ALL, sync_each_batch=False)
    best = plan(LLAMA_8B, **kw)
    card = 80 * GIB
    margin = 1 - (best.memory.total - 0.005 * card) / card  # the pick now misses by half a percent of the card
    tighter = plan(LLAMA_8B, safety_margin=margin, **kw)
    assert (tighter.strategy, tighter.activation_checkpointing) != (best.strategy, best.activation_checkpointing)
    match = re.search(r"fits with safety_margin=([0-9.]+)", tighter.margin_note)
    assert match and "under 1 % of the card" in tighter.margin_note and "margin: " in tighter.explain()
    again = plan(LLAMA_8B, safety_margin=float(match.group(1)), **kw)
    assert (again.strategy, again.micro_batch_size, again.activation_checkpointing) == (
        best.strategy, best.micro_batch_size, best.activation_checkpointing)  # fmt: skip
    assert best.margin_note == ""


def test_sp_on_cpu_ranks_runs_at_micro_batch_1_and_accumulation_keeps_the_global_batch():
    """--sp_size 2 on 2 CPU ranks planned micro-batch 16 and died after a minute in torch's `view`: DeepSpeed's SP data
    adapter leaves each CPU rank's labels a strided view once the micro-batch is above 1 (docs/parallelism.md)."""
    import hf_dist
    from hf_dist.testing import tiny_llama_config

    tiny = tiny_llama_config()
    split = plan(tiny, gpus=2, sp_size=2, strategy="zero2", seq_len=64, global_batch_size=16, features=ALL)
    assert (split.micro_batch_size, split.gradient_accumulation_steps, split.global_batch_size) == (1, 16, 16)
    refusal = (
        r"micro_batch_size 16 \(per_device_train_batch_size\) cannot run: Ulysses sequence parallelism "
        r"\(sp=2\) runs on CPU ranks at micro-batch 1 only.*\n  To keep the global batch: micro_batch 1 x "
        r"gradient_accumulation_steps 16 x data_parallel 1 = 16; pass micro_batch_size 1 with "
        r"gradient_accumulation_steps 16, or global_batch_size 16 alone"
    )
    with pytest.raises(PlanError, match=refusal):
        plan(tiny, gpus=2, sp_size=2, strategy="zero2", seq_len=64, micro_batch_size=16, features=ALL)
    # the same through auto_args' per_device_train_batch_size, where the installed libraries have SP at all
    installed = (
        "sp_size 2 cannot run here: needs accelerate" if not installed_features().sequence_parallel else refusal
    )
    with pytest.raises(ValueError, match=installed):
        hf_dist.auto_args(tiny, gpus=2, sp_size=2, strategy="zero2", seq_len=64, per_device_train_batch_size=16)
    # unpinned, a CPU SP layout is planned at micro-batch 1 only; GPUs copy each rank's slice: any micro-batch runs
    assert plan(tiny, gpus=2, sp_size=2, seq_len=64, features=ALL).micro_batch_size == 1
    gpus = plan(tiny, gpus=8, gpu_memory_gib=80, sp_size=2, strategy="zero2", seq_len=64, micro_batch_size=4,
                features=ALL)  # fmt: skip
    assert gpus.micro_batch_size == 4
