"""FSDP factory: the dict TrainingArguments takes, and what accelerate's plugin makes of it."""

import pytest
import torch

from hf_dist.configs.fsdp import apply_fp32_reduce, fsdp_config, fsdp_plugin_kwargs
from hf_dist.configs.training_args import strategy_args
from hf_dist.planning.features import LibraryFeatures, installed_features
from hf_dist.planning.layout import Layout

FEATURES = installed_features()


def test_installed_stack_uses_fsdp2():
    # torch 2.13 / accelerate 1.15 / transformers 5.x all support FSDP2; FSDP1 is deprecated there.
    assert FEATURES.fsdp_version == 2


def test_full_shard_fields():
    out = fsdp_config(
        "fsdp_full_shard", wrap_classes=["LlamaDecoderLayer"], activation_checkpointing=True, features=FEATURES
    )
    # newer transformers 5.x deprecate the string/list forms; 5.0 reads the string
    assert out["fsdp"] == (True if FEATURES.fsdp_flag_takes_bool else "full_shard auto_wrap")
    cfg = out["fsdp_config"]
    assert cfg["version"] == 2
    assert cfg["reshard_after_forward"] is True
    assert cfg["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert cfg["activation_checkpointing"] is True
    assert cfg["state_dict_type"] == "SHARDED_STATE_DICT"
    assert cfg["cpu_offload"] is False
    assert "parallelism_config" not in out


def test_shard_grad_op_keeps_params_after_forward_and_offload_maps_to_cpu_offload():
    assert fsdp_config("fsdp_shard_grad_op")["fsdp_config"]["reshard_after_forward"] is False
    assert fsdp_config("fsdp_full_shard", offload="optimizer+params")["fsdp_config"]["cpu_offload"] is True
    # FSDP2 offloads params, grads and optimizer together: no optimizer-only offload, and none for
    # shard_grad_op, which keeps the gathered parameters anyway (same rule as the memory model)
    with pytest.raises(ValueError, match="allowed: none, optimizer\\+params.*zero2/zero3"):
        fsdp_config("fsdp_full_shard", offload="optimizer")
    with pytest.raises(ValueError, match="allowed: none\\."):
        fsdp_config("fsdp_shard_grad_op", offload="optimizer+params")


def test_hsdp_builds_replicate_by_shard_mesh():
    out = strategy_args(Layout("hsdp", world_size=16, nodes=2))
    assert out["parallelism_config"] == {"dp_replicate_size": 2, "dp_shard_size": 8}
    assert "parallelism_config" not in strategy_args(Layout("fsdp_full_shard", world_size=16, nodes=2))
    with pytest.raises(ValueError, match="hsdp replicates across nodes and needs nodes >= 2"):
        Layout("hsdp", world_size=8, nodes=1)


def test_fsdp1_fallback_form():
    old = LibraryFeatures(fsdp_version=1, fsdp_flag_takes_bool=False)
    out = fsdp_config("hsdp", offload="optimizer+params", features=old)
    assert out["fsdp_config"]["version"] == 1 and out["fsdp_config"]["reshard_after_forward"] == "hybrid_shard"
    assert out["fsdp"] == "hybrid_shard auto_wrap offload"
    assert "parallelism_config" not in strategy_args(Layout("hsdp", world_size=16, nodes=2), features=old)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "zero3"}, "unknown FSDP strategy 'zero3'; allowed: fsdp_full_shard"),
        ({"strategy": "fsdp_full_shard", "offload": "disk"}, "unknown offload for fsdp_full_shard 'disk'"),
        ({"strategy": "fsdp_full_shard", "mixed_precision": "fp8"}, "unknown mixed_precision 'fp8'"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fsdp_config(**kwargs)


def test_training_args_plugin_gets_our_settings(tmp_path):
    from transformers import TrainingArguments

    kw = fsdp_config(
        "fsdp_shard_grad_op", wrap_classes=["LlamaDecoderLayer"], activation_checkpointing=True, features=FEATURES
    )
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kw)
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2
    assert plugin["reshard_after_forward"] is False
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    # newer transformers forward it to the plugin; older ones (5.0) copy fsdp_config's onto it in Trainer.__init__
    assert plugin.get("activation_checkpointing", args.fsdp_config.get("activation_checkpointing")) is True
    # transformers 5.0 does not forward it; accelerate's FSDP2 default is then the same SHARDED_STATE_DICT
    assert plugin.get("state_dict_type", "SHARDED_STATE_DICT") == "SHARDED_STATE_DICT"


def test_apply_fp32_reduce_reaches_the_accelerate_plugin(tmp_path):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, **fsdp_config("fsdp_full_shard", features=FEATURES)
    )
    apply_fp32_reduce(args)
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.bfloat16,
    )
    # accelerate's AcceleratorState calls this with the run's mixed precision; it must not clobber ours.
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32


def test_without_apply_accelerate_reduces_in_bf16():
    """Documents the default behaviour our docs describe: bf16 reduce unless apply_fp32_reduce is used."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16


def test_plugin_kwargs_construct_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        **fsdp_plugin_kwargs("fsdp_full_shard", wrap_classes=["LlamaDecoderLayer"])
    )
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
