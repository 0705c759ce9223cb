"""The strategy registry and the typed run layout (hf_dist/planning/layout.py)."""

from __future__ import annotations

import pytest

from hf_dist.planning.layout import (
    REGISTRY,
    STRATEGIES,
    CheckpointFamily,
    Engine,
    Layout,
    fsdp_mode_strategy,
    strategy,
    zero_stage_strategy,
)


def test_user_facing_names_are_unchanged():
    assert STRATEGIES == ("ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op", "hsdp")


def test_every_strategy_has_one_engine_and_a_consistent_checkpoint_family():
    for s in REGISTRY.values():
        assert [s.is_ddp, s.is_fsdp, s.is_deepspeed].count(True) == 1
        if s.is_deepspeed:
            assert s.checkpoint.is_zero and s.zero_stage in (1, 2, 3) and not s.reshards
            assert zero_stage_strategy(s.zero_stage) is s
        if s.is_fsdp:
            assert s.checkpoint is CheckpointFamily.DCP and s.reshards
            assert fsdp_mode_strategy(s.fsdp_mode) is s
        assert s.offloads[0] == "none"
        assert s.description


def test_sharding_grows_with_the_zero_stage():
    stages = [zero_stage_strategy(n).shards for n in (1, 2, 3)]
    assert [(x.params, x.grads, x.optimizer) for x in stages] == [
        (False, False, True),
        (False, True, True),
        (True, True, True),
    ]
    assert not any(vars(strategy("ddp").shards).values())


def test_preferences_are_a_total_order_simplest_first():
    order = sorted(REGISTRY.values(), key=lambda s: s.preference)
    assert len({s.preference for s in order}) == len(order)
    assert order[0].engine is Engine.DDP


def test_unknown_names_list_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown strategy 'zero4'; allowed: ddp, zero1"):
        strategy("zero4")
    with pytest.raises(ValueError, match="ZeRO stage 0"):
        zero_stage_strategy(0)
    with pytest.raises(ValueError, match="allowed: full_shard, shard_grad_op, hybrid_shard"):
        fsdp_mode_strategy("no_shard")


def test_layout_sizes_use_parallelism_config_names():
    hsdp = Layout("hsdp", world_size=16, nodes=2)
    assert (hsdp.dp_shard_size, hsdp.dp_replicate_size, hsdp.gpus_per_node) == (8, 2, 8)
    zero3 = Layout("zero3", world_size=16, nodes=2)
    assert (zero3.dp_shard_size, zero3.dp_replicate_size) == (16, 1)
    ddp = Layout("ddp", world_size=4)
    assert (ddp.dp_shard_size, ddp.dp_replicate_size) == (1, 4)
    assert Layout("zero3", 8, offload="optimizer").describe() == "zero3 x 8 ranks, offload optimizer, bf16"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(strategy="ddp", world_size=6, nodes=4), r"world_size 6 is not divisible by nodes 4 \(6 / 4 = 1.5\)"),
        (dict(strategy="hsdp", world_size=8), "needs nodes >= 2, got nodes=1"),
        (dict(strategy="fsdp_full_shard", world_size=8, offload="optimizer"), "allowed: none, optimizer\\+params"),
        (dict(strategy="ddp", world_size=0), "world_size must be a positive int, got 0"),
        (dict(strategy="ddp", world_size=6, tp_size=4), r"tp_size \* cp_size \* sp_size = 4 \* 1 \* 1 = 4"),
        (dict(strategy="ddp", mixed_precision="fp16", pure_bf16=True), "pure_bf16 needs mixed_precision='bf16'"),
        (dict(strategy="ddp", offload="disk"), "unknown offload 'disk'; allowed: none, optimizer, optimizer\\+params"),
    ],
)
def test_layout_refuses_what_does_not_fit_and_prints_the_arithmetic(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_layout_is_frozen_and_takes_a_name_or_a_strategy():
    layout = Layout(strategy("zero2"), 2)
    assert layout == Layout("zero2", 2)
    with pytest.raises(AttributeError):
        layout.world_size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(strategy="fsdp_full_shard", world_size=16, nodes=2, tp_size=16),
            "tp_size 16 does not divide the 8 GPUs",
        ),
        (dict(strategy="zero3", world_size=8, tp_size=2), "AutoTP runs with ZeRO stage <= 2"),
        (dict(strategy="zero3", world_size=8, cp_size=2), "context parallelism .* runs only with FSDP2"),
        (dict(strategy="fsdp_full_shard", world_size=8, sp_size=2), "Ulysses.* runs only with DeepSpeed"),
        (dict(strategy="zero2", world_size=8, tp_size=2, sp_size=2), "AutoTP and Ulysses do not compose"),
        (dict(strategy="ddp", world_size=8, tp_size=3), r"2 \* 1|does not divide world_size 8|= 3 does not divide"),
        (
            dict(strategy="zero2", world_size=8, offload="optimizer", offload_device="nvme"),
            "ZeRO-Infinity, which needs zero3",
        ),
        (dict(strategy="zero3", world_size=8, offload_device="nvme"), "needs zero3 and offload 'optimizer'"),
        (dict(strategy="zero3", world_size=8, offload="optimizer", offload_device="disk"), "unknown offload_device"),
    ],
)
def test_model_parallel_sizes_are_checked_against_engine_and_machines(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_model_parallel_sizes_leave_the_rest_to_data_parallelism():
    layout = Layout("fsdp_full_shard", world_size=64, nodes=8, tp_size=8)
    assert (layout.dp_size, layout.dp_shard_size, layout.dp_replicate_size) == (8, 8, 1)
    assert Layout("zero3", 8, offload="optimizer+params", offload_device="nvme").describe() == (
        "zero3 x 8 ranks, offload optimizer+params to NVMe, bf16"
    )
    assert Layout("zero2", 8, sp_size=4).describe() == "zero2 x 8 ranks, sp=4, bf16"


def test_the_model_must_split_by_the_sizes():
    from hf_dist.planning.modelinfo import model_spec
    from hf_dist.testing import tiny_llama_config

    spec = model_spec(tiny_llama_config())  # 4 heads, 2 KV heads
    Layout("fsdp_full_shard", 8, tp_size=2).check_model(spec, 64)
    with pytest.raises(ValueError, match=r"tp_size 4 does not divide the model's 2 KV heads \(2 % 4 = 2\)"):
        Layout("fsdp_full_shard", 8, tp_size=4).check_model(spec, 64)
    with pytest.raises(ValueError, match=r"cp_size 4 needs a sequence length divisible by 8, got 60"):
        Layout("fsdp_full_shard", 8, cp_size=4).check_model(spec, 60)
    Layout("zero1", 8, sp_size=4).check_model(spec, 64)  # 4 query heads; DeepSpeed replicates the 2 KV heads
    with pytest.raises(ValueError, match="sp_size 8 does not divide the model's 4 attention heads"):
        Layout("zero1", 8, sp_size=8).check_model(spec, 64)
