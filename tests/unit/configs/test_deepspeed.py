"""DeepSpeed JSON factory: stages, offload, precision, and acceptance by DeepSpeed's own config parser."""

import pytest

from hf_dist.configs.deepspeed import deepspeed_config


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_and_auto_fields(stage):
    cfg = deepspeed_config(f"zero{stage}")
    assert cfg["zero_optimization"]["stage"] == stage
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
    ):
        assert cfg[key] == "auto"
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"]["enabled"] is False
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    assert cfg["zero_allow_untested_optimizer"] is True
    assert "optimizer" not in cfg and "scheduler" not in cfg  # Trainer's optimizer/scheduler: one LR source
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert ("stage3_gather_16bit_weights_on_model_save" in cfg["zero_optimization"]) == (stage == 3)


def test_zero3_offload_optimizer_and_params():
    zero = deepspeed_config("zero3", offload="optimizer+params")["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    # explicit DeepSpeed defaults, the same numbers the memory model counts
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (int(5e8), int(5e7))


def test_zero2_offload_optimizer_only_and_cpu_adam_switch():
    cfg = deepspeed_config("zero2", offload="optimizer")
    assert "offload_param" not in cfg["zero_optimization"]
    assert "zero_force_ds_cpu_optimizer" not in cfg  # default: accelerate swaps in DeepSpeedCPUAdam
    assert deepspeed_config("zero2", offload="optimizer", cpu_adam=False)["zero_force_ds_cpu_optimizer"] is False


def test_param_offload_needs_zero3():
    with pytest.raises(ValueError, match="needs ZeRO-3.*got zero2"):
        deepspeed_config("zero2", offload="optimizer+params")


def test_fp16_variant_has_dynamic_loss_scaling():
    cfg = deepspeed_config("zero2", mixed_precision="fp16")
    assert cfg["bf16"]["enabled"] is False
    assert cfg["fp16"]["enabled"] is True and cfg["fp16"]["loss_scale"] == 0  # 0 = dynamic


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown DeepSpeed strategy 'fsdp_full_shard'; allowed: zero1, zero2, zero3"):
        deepspeed_config("fsdp_full_shard")


@pytest.mark.parametrize(
    "strategy, offload", [("zero1", "none"), ("zero2", "optimizer"), ("zero3", "optimizer+params")]
)
def test_deepspeed_parses_it(strategy, offload):
    """DeepSpeed's own config parser accepts the JSON once the Trainer's "auto" values are filled in."""
    pytest.importorskip("deepspeed")
    import json

    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = deepspeed_config(strategy, offload=offload)
    text = json.dumps(cfg)
    for key, value in (("train_micro_batch_size_per_gpu", 2), ("gradient_accumulation_steps", 4)):
        cfg[key] = value
    cfg["train_batch_size"] = 8
    cfg["gradient_clipping"] = 1.0
    zero = cfg["zero_optimization"]
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if zero.get(key) == "auto":
            zero[key] = 4096
    parsed = DeepSpeedConfig(cfg)
    assert parsed.zero_optimization_stage == int(strategy[-1])
    # deepspeed 0.17 exposes bfloat16_enabled; later versions a bfloat16_config section
    bf16 = parsed.bfloat16_config.enabled if hasattr(parsed, "bfloat16_config") else parsed.bfloat16_enabled
    assert bf16 is True
    assert parsed.grad_accum_dtype == "fp32"
    assert parsed.zero_allow_untested_optimizer is True
    assert parsed.zero_config.offload_optimizer is None or parsed.zero_config.offload_optimizer.device == "cpu"
    assert json.loads(text) == deepspeed_config(strategy, offload=offload)  # JSON-serialisable as is
