"""auto_args(): plan -> TrainingArguments kwargs that the installed transformers accepts.

bf16 needs a GPU or `use_cpu=True` in TrainingArguments, so the GPU plans below are constructed
with `use_cpu=True` added; everything else (fsdp/deepspeed/parallelism/ checkpointing/batch
fields) is exactly what a GPU run would get.
"""

import pytest
from transformers import TrainingArguments

from hf_dist.configs.fsdp import fsdp_config
from hf_dist.configs.training_args import DEFAULT_DDP_TIMEOUT_S, _ac_names, auto_args
from hf_dist.hardware import Hardware
from hf_dist.testing import tiny_llama_config

CFG = tiny_llama_config()
GPU = dict(gpus=4, gpu_memory_gib=80, seq_len=64, global_batch_size=16)
# transformers 5.23 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); probe, don't assume.
AC_FLAG, AC_KWARGS = _ac_names()


@pytest.fixture(autouse=True)
def _forget_deepspeed_config():
    """A DeepSpeed TrainingArguments registers a process-global config; don't leak ZeRO-3 into later tests."""
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def build(tmp_path, **kwargs):
    return TrainingArguments(output_dir=str(tmp_path), **kwargs)


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "fsdp_shard_grad_op"])
def test_fsdp_strategies(tmp_path, strategy):
    kw = auto_args(CFG, strategy=strategy, activation_checkpointing=True, **GPU)
    assert kw["bf16"] is True and kw["fsdp"] == fsdp_config(strategy)["fsdp"]  # True, or 5.0's string form
    assert kw["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert kw["fsdp_config"]["activation_checkpointing"] is True
    assert "activation_checkpointing" not in kw and "gradient_checkpointing" not in kw  # FSDP's own, not the model's
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] * 4 == 16
    assert kw["ddp_timeout"] == DEFAULT_DDP_TIMEOUT_S
    args = build(tmp_path, use_cpu=True, **kw)
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    assert args.fsdp_plugin_args["reshard_after_forward"] is (strategy == "fsdp_full_shard")
    assert args.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    assert getattr(args, AC_FLAG) is False


def test_hsdp_two_nodes(tmp_path):
    kw = auto_args(CFG, strategy="hsdp", **{**GPU, "gpus": 8}, nodes=2)
    pc = kw["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size) == (2, 4)
    args = build(tmp_path, use_cpu=True, **kw)
    assert args.parallelism_config is pc and args.fsdp_plugin_args["fsdp_version"] == 2


@pytest.mark.parametrize(
    "strategy, offload", [("zero1", "none"), ("zero2", "optimizer"), ("zero3", "optimizer+params")]
)
def test_deepspeed_strategies(tmp_path, strategy, offload):
    pytest.importorskip("deepspeed")
    kw = auto_args(CFG, strategy=strategy, offload=offload, activation_checkpointing=True, cpu_adam=False, **GPU)
    ds = kw["deepspeed"]
    assert ds["zero_optimization"]["stage"] == int(strategy[-1])
    assert ds["bf16"]["enabled"] is True
    assert ds.get("zero_force_ds_cpu_optimizer", True) is (offload == "none")  # cpu_adam=False keeps torch AdamW
    assert kw[AC_FLAG] is True
    assert kw[AC_KWARGS] == {"use_reentrant": False}
    args = build(tmp_path, use_cpu=True, **kw)
    assert args.deepspeed_plugin is not None
    assert args.hf_deepspeed_config.config["train_micro_batch_size_per_gpu"] == kw["per_device_train_batch_size"]


def test_ddp_and_plain_cpu_plan(tmp_path):
    kw = auto_args(CFG, strategy="ddp", **GPU)
    assert kw["ddp_find_unused_parameters"] is False and "fsdp" not in kw and "deepspeed" not in kw
    build(tmp_path, use_cpu=True, **kw)
    # No GPU given: the plan is for this CPU machine, so no bf16/fp16 and TrainingArguments builds as is.
    cpu = auto_args(CFG, seq_len=64, global_batch_size=4)
    assert "bf16" not in cpu and "fp16" not in cpu
    build(tmp_path, **cpu)


def test_fp16_hardware(tmp_path):
    v100 = Hardware(device="cuda", gpus_per_node=4, gpu_memory_gib=32, bf16=False, fp16=True)
    kw = auto_args(CFG, hardware=v100, strategy="zero2", seq_len=64, global_batch_size=16)
    assert kw["fp16"] is True and "bf16" not in kw
    assert kw["deepspeed"]["fp16"]["enabled"] is True and kw["deepspeed"]["bf16"]["enabled"] is False
    with pytest.raises(ValueError, match="bf16=True but the hardware .* has no bf16 support"):
        auto_args(CFG, hardware=v100, strategy="zero2", seq_len=64, bf16=True)


def test_batch_arithmetic_contradiction():
    with pytest.raises(
        ValueError,
        match=r"per_device_train_batch_size\(2\) \* gradient_accumulation_steps\(3\) \* world_size\(4\) = 24 "
        r"!= global_batch_size\(32\)",
    ):
        auto_args(
            CFG, **{**GPU, "global_batch_size": 32}, per_device_train_batch_size=2, gradient_accumulation_steps=3
        )


def test_user_batch_and_overrides_win():
    kw = auto_args(CFG, **GPU, per_device_train_batch_size=2, ddp_timeout=600, learning_rate=1e-4, strategy="ddp")
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (2, 2)  # 2 * 2 * 4 = 16
    assert kw["ddp_timeout"] == 600 and kw["learning_rate"] == 1e-4
    kw = auto_args(CFG, **{**GPU, "global_batch_size": None}, micro_batch_size=1, gradient_accumulation_steps=5)
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"]) == (1, 5)


def test_precision_override_keeps_deepspeed_consistent(tmp_path):
    kw = auto_args(CFG, strategy="zero2", bf16=False, **GPU)
    assert kw["bf16"] is False and kw["deepspeed"]["bf16"]["enabled"] is False
    build(tmp_path, **kw)  # the Trainer's DeepSpeed config check sees matching values


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "fsdp_full_shard", "deepspeed": {"zero_optimization": {"stage": 3}}}, "cannot both be on"),
        ({"strategy": "zero3", "fsdp": True}, "cannot both be on"),
        ({"strategy": "fsdp_full_shard", "gradient_checkpointing": True}, "redundant all-gather"),
        ({"strategy": "ddp", "not_a_field": 1}, r"unknown keyword\(s\) \['not_a_field'\]"),
        (
            {"micro_batch_size": 2, "per_device_train_batch_size": 4},
            r"micro_batch_size \(2\) != per_device_train_batch_size \(4\)",
        ),
        ({"bf16": True, "fp16": True, "strategy": "ddp"}, "bf16=True and fp16=True"),
    ],
)
def test_contradictions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        auto_args(CFG, **GPU, **kwargs)


def test_lr_scaling():
    linear = auto_args(
        CFG, **{**GPU, "global_batch_size": 32}, lr_scaling="linear", reference_batch_size=8, learning_rate=1e-4
    )
    assert linear["learning_rate"] == pytest.approx(4e-4)
    warmup_key = "warmup_ratio" if "warmup_ratio" in TrainingArguments.__dataclass_fields__ else "warmup_steps"
    assert linear[warmup_key] == 0.03
    sqrt = auto_args(
        CFG,
        **{**GPU, "global_batch_size": 32},
        lr_scaling="sqrt",
        reference_batch_size=8,
        learning_rate=1e-4,
        warmup_steps=10,
    )
    assert sqrt["learning_rate"] == pytest.approx(2e-4) and sqrt["warmup_steps"] == 10
    assert "learning_rate" not in auto_args(CFG, **GPU)  # off by default
    with pytest.raises(ValueError, match="needs reference_batch_size"):
        auto_args(CFG, **GPU, lr_scaling="linear", learning_rate=1e-4)
    with pytest.raises(ValueError, match="unknown lr_scaling 'cubic'"):
        auto_args(CFG, **GPU, lr_scaling="cubic", reference_batch_size=8, learning_rate=1e-4)


def test_deepspeed_launch_config_clash(monkeypatch):
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "zero_stage,offload_optimizer_device,mixed_precision")
    with pytest.raises(ValueError, match="launched with an accelerate DeepSpeed config"):
        auto_args(CFG, strategy="zero2", **GPU)
