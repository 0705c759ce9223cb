"""Precision: the loaded dtype, fp32 master weights by default, pure bf16 only when asked for."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_dist.auto import auto_args
from hf_dist.cli.main import main
from hf_dist.configs.deepspeed import deepspeed_config
from hf_dist.configs.request import PLAN_KEYS
from hf_dist.planning.hardware import Hardware
from hf_dist.planning.planner import plan
from hf_dist.planning.precision import loaded_dtype
from hf_dist.testing import tiny_llama_config

CFG = tiny_llama_config()
BF16_GPUS = Hardware(device="cuda", gpus_per_node=2, gpu_memory_gib=80.0, bf16=True, fp16=True)
V100S = Hardware(device="cuda", gpus_per_node=2, gpu_memory_gib=32.0, gpu_name="Tesla V100", fp16=True)
CPU = Hardware(device="cpu", gpus_per_node=2, gpu_memory_gib=8.0)


@pytest.fixture(autouse=True)
def _forget_deepspeed_config():
    yield
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def tiny(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CFG, dtype=dtype)


def param_dtypes(model, trainable=None) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters() if trainable is None or p.requires_grad is trainable}


def upcast_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("hf_dist") and "upcast" in r.getMessage()]


# ---------------------------------------------------------------- the plan


def test_default_plan_keeps_fp32_master_weights_and_says_so():
    p = plan(tiny(), hardware=BF16_GPUS, strategy="ddp", seq_len=16)
    assert (p.pure_bf16, p.model_dtype, p.optimizer_state_dtype) == (False, "bfloat16", "float32")
    first = p.explain().splitlines()[0]
    assert "precision=bf16 mixed precision (fp32 master weights and Adam state)" in first
    assert "model loaded in bfloat16" in first
    data = json.loads(json.dumps(p.to_dict()))
    assert (data["pure_bf16"], data["optimizer_state_dtype"], data["model_dtype"]) == (False, "float32", "bfloat16")


def test_pure_bf16_plan_drops_master_weights():
    default = plan(CFG, hardware=BF16_GPUS, strategy="ddp", seq_len=16)
    pure = plan(CFG, hardware=BF16_GPUS, strategy="ddp", seq_len=16, pure_bf16=True)
    assert (pure.pure_bf16, pure.optimizer_state_dtype, pure.model_dtype) == (True, "bfloat16", None)
    # 4 bytes per trainable param less: the fp32 master copy (ZeRO paper sec. 3.1)
    assert default.memory.optimizer - pure.memory.optimizer == 4 * pure.num_params
    first = pure.explain().splitlines()[0]
    assert "precision=bf16 (pure bf16: bf16 weights and Adam state, no fp32 master weights)" in first
    assert pure.to_dict()["optimizer_state_dtype"] == "bfloat16" and pure.to_dict()["pure_bf16"] is True
    assert "pure_bf16" in PLAN_KEYS


@pytest.mark.parametrize(("hardware", "precision"), [(V100S, "fp16"), (CPU, "no")])
def test_other_precisions_keep_fp32_optimizer_state(hardware, precision):
    p = plan(CFG, hardware=hardware, strategy="ddp", seq_len=16)
    assert (p.mixed_precision, p.optimizer_state_dtype) == (precision, "float32")


@pytest.mark.parametrize(("hardware", "where"), [(V100S, "Tesla V100"), (CPU, "cpu")])
def test_pure_bf16_without_bf16_hardware_is_refused(hardware, where):
    with pytest.raises(
        ValueError, match=rf"pure_bf16=True needs bf16 support, but the hardware \({where}, bf16=False"
    ):
        plan(CFG, hardware=hardware, pure_bf16=True)
    with pytest.raises(ValueError, match="needs bf16 support"):
        auto_args(tiny(), hardware=hardware, pure_bf16=True)


def test_pure_bf16_must_be_a_bool():
    with pytest.raises(ValueError, match="pure_bf16 must be True or False, got 'yes'"):
        plan(CFG, hardware=BF16_GPUS, pure_bf16="yes")


# ---------------------------------------------------------------- the loaded dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loaded_dtype_of_modules(dtype):
    assert loaded_dtype(tiny(dtype)) == str(dtype).removeprefix("torch.")


def test_names_configs_and_counts_have_no_loaded_dtype():
    assert loaded_dtype(CFG) is None and loaded_dtype(1_000_000) is None and loaded_dtype("meta-llama/x") is None


def test_unknown_dtype_is_refused_before_training():
    model = tiny(torch.float64)
    with pytest.raises(ValueError, match=r"parameter 'model.embed_tokens.weight' is float64; hf_dist plans models"):
        plan(model, hardware=BF16_GPUS)
    with pytest.raises(ValueError, match="Load the model with dtype=torch.bfloat16"):
        auto_args(model, hardware=BF16_GPUS)


def test_peft_lora_base_dtype_is_the_loaded_dtype():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert loaded_dtype(model) == "bfloat16"  # fp32 adapters (PEFT's autocast_adapter_dtype) do not change it


# ---------------------------------------------------------------- auto_args and the model it was given


def test_ddp_upcasts_a_bf16_model_with_one_warning(caplog):
    model = tiny()
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        kwargs = auto_args(model, hardware=BF16_GPUS, strategy="ddp", seq_len=16)
    assert kwargs["bf16"] is True
    assert param_dtypes(model) == {torch.float32}
    records = upcast_records(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert "upcast 21 trainable bfloat16 parameter tensors" in message and "pure_bf16=True" in message
    # a second call finds nothing to upcast and says nothing
    caplog.clear()
    auto_args(model, hardware=BF16_GPUS, strategy="ddp", seq_len=16)
    assert upcast_records(caplog) == []


def test_pure_bf16_keeps_the_model_bf16(caplog):
    model = tiny()
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        kwargs = auto_args(model, hardware=BF16_GPUS, strategy="ddp", seq_len=16, pure_bf16=True)
    assert kwargs["bf16"] is True and param_dtypes(model) == {torch.bfloat16}
    assert upcast_records(caplog) == []


def test_pure_bf16_refuses_a_model_not_loaded_in_bf16():
    with pytest.raises(ValueError, match="trainable float32 parameters; load it with dtype=torch.bfloat16"):
        auto_args(tiny(torch.float32), hardware=BF16_GPUS, strategy="ddp", seq_len=16, pure_bf16=True)


def test_lora_upcasts_only_the_trainable_adapters():
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(tiny(), lora, autocast_adapter_dtype=False)  # bf16 adapters
    assert param_dtypes(model, trainable=True) == {torch.bfloat16}
    auto_args(model, hardware=BF16_GPUS, strategy="ddp", method="lora", seq_len=16)
    assert param_dtypes(model, trainable=True) == {torch.float32}
    assert param_dtypes(model, trainable=False) == {torch.bfloat16}  # autocast computes in bf16 anyway


def test_fp16_model_is_upcast_for_fp16_mixed_precision():
    model = tiny(torch.float16)  # fp16 weights under fp16 AMP: GradScaler refuses to unscale fp16 gradients
    kwargs = auto_args(model, hardware=V100S, strategy="ddp", seq_len=16)
    assert kwargs["fp16"] is True and param_dtypes(model) == {torch.float32}


def test_quantized_and_integer_parameters_are_never_touched():
    model = tiny()
    model.register_parameter("codes", torch.nn.Parameter(torch.zeros(8, dtype=torch.int8), requires_grad=False))
    auto_args(model, hardware=CPU, strategy="ddp", seq_len=16)  # fp32 training: every float param is upcast
    assert model.codes.dtype == torch.int8
    assert {p.dtype for n, p in model.named_parameters() if n != "codes"} == {torch.float32}


def test_fp32_training_upcasts_frozen_params_too():
    model = tiny()
    model.model.embed_tokens.weight.requires_grad_(False)
    auto_args(model, hardware=CPU, strategy="zero2", seq_len=16)  # no autocast bridges bf16 and fp32 on CPU
    assert param_dtypes(model) == {torch.float32}


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "zero2"])
def test_fsdp_and_deepspeed_keep_fp32_masters_themselves(strategy, caplog):
    model = tiny()
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        kwargs = auto_args(model, hardware=BF16_GPUS, strategy=strategy, seq_len=16)
    assert kwargs["bf16"] is True and param_dtypes(model) == {torch.bfloat16}
    assert upcast_records(caplog) == []
    if strategy == "zero2":
        assert kwargs["deepspeed"]["bf16"] == {"enabled": True}
        assert kwargs["deepspeed"]["data_types"] == {"grad_accum_dtype": "fp32"}


def test_pure_bf16_fsdp_turns_mixed_precision_off():
    kwargs = auto_args(tiny(), hardware=BF16_GPUS, strategy="fsdp_full_shard", seq_len=16, pure_bf16=True)
    assert kwargs["bf16"] is False  # accelerate upcasts FSDP2 shards to fp32 whenever mixed precision is on
    with pytest.raises(ValueError, match="pure_bf16=True with fsdp_full_shard needs bf16=False"):
        auto_args(tiny(), hardware=BF16_GPUS, strategy="fsdp_full_shard", seq_len=16, pure_bf16=True, bf16=True)


def test_pure_bf16_ddp_and_zero_need_bf16_true():
    for strategy in ("ddp", "zero3"):
        with pytest.raises(ValueError, match=f"pure_bf16=True with {strategy} needs bf16=True, got bf16=False"):
            auto_args(tiny(), hardware=BF16_GPUS, strategy=strategy, seq_len=16, pure_bf16=True, bf16=False)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_pure_bf16_deepspeed_config(strategy):
    kwargs = auto_args(CFG, hardware=BF16_GPUS, strategy=strategy, seq_len=16, pure_bf16=True)
    ds = kwargs["deepspeed"]
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    # fp32 accumulation would make DeepSpeed pick BF16_Optimizer for ZeRO-1, which always keeps fp32 masters
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"}
    assert deepspeed_config(strategy, pure_bf16=True) == ds


def test_pure_bf16_deepspeed_refusals():
    with pytest.raises(ValueError, match="pure_bf16=True keeps bf16 weights and Adam state and needs mixed_precision"):
        deepspeed_config("zero2", mixed_precision="fp16", pure_bf16=True)
    hw = Hardware(device="cuda", gpus_per_node=2, gpu_memory_gib=80.0, bf16=True)
    with pytest.raises(ValueError, match="needs DeepSpeedCPUAdam .* but cpu_adam=False"):
        auto_args(CFG, hardware=hw, strategy="zero3", offload="optimizer", cpu_adam=False, pure_bf16=True)


# ---------------------------------------------------------------- CLIs


def test_cli_plan_pure_bf16(tmp_path, capsys):
    CFG.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus", "2", "--gpu-memory", "80", "--pure-bf16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["pure_bf16"], data["optimizer_state_dtype"]) == (True, "bfloat16")
    assert main(["plan", str(tmp_path), "--gpus", "2", "--gpu-memory", "80"]) == 0
    assert "fp32 master weights and Adam state" in capsys.readouterr().out


def test_cli_config_pure_bf16(tmp_path, capsys):
    import yaml

    out = tmp_path / "ds.json"
    assert main(["config", "--strategy", "zero2", "--format", "deepspeed", "--pure-bf16", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["bf16"]["bf16_optimizer_states"] is True
    fsdp = tmp_path / "fsdp.yaml"
    assert main(["config", "--strategy", "fsdp_full_shard", "--pure-bf16", "--out", str(fsdp)]) == 0
    assert yaml.safe_load(fsdp.read_text())["mixed_precision"] == "no"
    assert "accelerate\n# upcasts the FSDP2 shards" in fsdp.read_text()
    assert main(["config", "--strategy", "zero3", "--pure-bf16"]) == 1
    assert "--format deepspeed --pure-bf16" in capsys.readouterr().err
    assert main(["config", "--strategy", "ddp", "--pure-bf16", "--mixed-precision", "fp16"]) == 1
    assert "needs --mixed-precision bf16" in capsys.readouterr().err


def test_plan_callback_expects_bf16_false_for_pure_bf16_fsdp():
    from hf_dist.callbacks.plan import plan_mismatches

    p = plan(CFG, hardware=BF16_GPUS, strategy="fsdp_full_shard", seq_len=16, pure_bf16=True)
    live = {"strategy": "fsdp_full_shard", "world_size": 2, "mixed_precision": "no", "wrap_classes": None}
    assert plan_mismatches(p, live) == []
    assert plan_mismatches(p, {**live, "mixed_precision": "bf16"}) == ["mixed precision: planned no, running bf16"]
