"""The config factories take a Layout (a plan's ``layout``): the same config as the strategy name with the layout's
fields, a keyword that contradicts the layout refused, and a pure-bf16 layout's YAML precision."""

import pytest

import hf_dist
from hf_dist.configs.accelerate import accelerate_config
from hf_dist.configs.deepspeed import deepspeed_config
from hf_dist.configs.fsdp import fsdp_config
from hf_dist.planning.hardware import Hardware
from hf_dist.planning.layout import Layout
from hf_dist.testing import tiny_llama_config

DEEPSPEED_LAYOUTS = [
    Layout("zero2", 8, offload="optimizer", mixed_precision="fp16"),
    Layout("zero2", 8, tp_size=2),
    Layout("zero3", 8, sp_size=2, pure_bf16=True),
    Layout("zero3", 8, offload="optimizer+params", offload_device="nvme"),
    Layout("zero1", 4, mixed_precision="no"),
]
FSDP_LAYOUTS = [
    Layout("fsdp_full_shard", 8, activation_checkpointing=True, offload="optimizer+params"),
    Layout("fsdp_shard_grad_op", 4, mixed_precision="fp16"),
    Layout("hsdp", 16, 2),
]


@pytest.mark.parametrize("layout", DEEPSPEED_LAYOUTS, ids=Layout.describe)
def test_deepspeed_config_of_a_layout_is_the_named_call(layout):
    by_name = deepspeed_config(
        layout.strategy.name, offload=layout.offload, mixed_precision=layout.mixed_precision,
        pure_bf16=layout.pure_bf16, tp_size=layout.tp_size, sp_size=layout.sp_size,
        offload_device=layout.offload_device, nvme_path="/local/nvme", cpu_adam=False,
    )  # fmt: skip
    assert deepspeed_config(layout, nvme_path="/local/nvme", cpu_adam=False) == by_name


@pytest.mark.parametrize("layout", FSDP_LAYOUTS, ids=Layout.describe)
def test_fsdp_and_accelerate_configs_of_a_layout_are_the_named_calls(layout):
    wrap = ["LlamaDecoderLayer"]
    named = dict(offload=layout.offload, mixed_precision=layout.mixed_precision)
    named["activation_checkpointing"] = layout.activation_checkpointing
    assert fsdp_config(layout, wrap_classes=wrap) == fsdp_config(layout.strategy.name, wrap_classes=wrap, **named)
    yaml_named = accelerate_config(
        layout.strategy.name, num_processes=layout.world_size, nodes=layout.nodes, wrap_classes=wrap, **named
    )
    assert accelerate_config(layout, wrap_classes=wrap) == yaml_named
    assert yaml_named["num_processes"] == layout.world_size and yaml_named["num_machines"] == layout.nodes


def test_a_keyword_that_contradicts_the_layout_is_refused_naming_both():
    layout = Layout("zero3", 8, offload="optimizer")
    with pytest.raises(ValueError, match=r"holds offload='optimizer' and also offload='optimizer\+params'"):
        deepspeed_config(layout, offload="optimizer+params")
    with pytest.raises(ValueError, match="holds num_processes=8 and also num_processes=16"):
        accelerate_config(layout, num_processes=16)
    assert deepspeed_config(layout, offload="optimizer") == deepspeed_config(layout)  # the same value: accepted


def test_a_pure_bf16_layout_gets_the_yaml_precision_or_a_refusal():
    assert accelerate_config(Layout("fsdp_full_shard", 8, pure_bf16=True))["mixed_precision"] == "no"
    assert accelerate_config(Layout("ddp", 8, pure_bf16=True))["mixed_precision"] == "bf16"
    with pytest.raises(ValueError, match="inline DeepSpeed keys cannot set.*--pure-bf16"):
        accelerate_config(Layout("zero3", 8, pure_bf16=True))


def test_a_plans_layout_goes_to_each_format():
    hw = Hardware(device="cuda", gpus_per_node=8, gpu_memory_gib=24.0, peak_tflops=100.0)
    chosen = hf_dist.plan(tiny_llama_config(), hardware=hw, seq_len=64, global_batch_size=64, strategy="zero3")
    assert chosen.layout.strategy.name == "zero3"
    ds = deepspeed_config(chosen.layout)
    assert ds["zero_optimization"]["stage"] == 3
    assert accelerate_config(chosen.layout)["deepspeed_config"]["zero_stage"] == 3
