"""auto_args(): plan -> TrainingArguments kwargs that the installed transformers accepts.

bf16 needs a GPU or `use_cpu=True` in TrainingArguments, so the GPU plans below are constructed
with `use_cpu=True` added; everything else (fsdp/deepspeed/parallelism/ checkpointing/batch
fields) is exactly what a GPU run would get.
"""

import re

import pytest
from transformers import TrainingArguments

from hf_dist.auto import auto_args
from hf_dist.configs.fsdp import fsdp_config
from hf_dist.configs.training_args import DEFAULT_DDP_TIMEOUT_S
from hf_dist.planning.features import installed_features
from hf_dist.planning.hardware import Hardware
from hf_dist.testing import tiny_llama_config
from tests.unit.configs.test_model_parallel_configs import NEEDS_TP_LOAD

CFG = tiny_llama_config()
GPU = dict(gpus=4, gpu_memory_gib=80, seq_len=64, global_batch_size=16)
# transformers 5.23 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs); probe, don't assume.
AC_FLAG = installed_features().activation_checkpointing_field
AC_KWARGS = installed_features().activation_checkpointing_kwargs_field


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
    assert (
        kw["bf16"] is True and kw["fsdp"] == fsdp_config(strategy, features=installed_features())["fsdp"]
    )  # True, or 5.0's string
    assert kw["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert kw["fsdp_config"]["activation_checkpointing"] is True
    assert kw[AC_FLAG] is False  # FSDP's own, not the model's: said explicitly (TRL's SFTConfig defaults to True)
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
    assert cpu["bf16"] is False and cpu["fp16"] is False  # explicit: a subclass's bf16=True default loses
    build(tmp_path, **cpu)


def test_fp16_hardware(tmp_path):
    v100 = Hardware(device="cuda", gpus_per_node=4, gpu_memory_gib=32, bf16=False, fp16=True)
    kw = auto_args(CFG, hardware=v100, strategy="zero2", seq_len=64, global_batch_size=16)
    assert kw["fp16"] is True and kw["bf16"] is False
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


def test_accumulation_without_a_global_batch_is_planned():
    """gradient_accumulation_steps without global_batch_size: the plan is made for that accumulation (FSDP2 keeps
    unsharded gradients across micro-batches), so the run attach(trainer) checks is the planned one; a plan= given
    with another accumulation is refused."""
    from hf_dist.runtime.planned import carried_plan

    single = auto_args(CFG, strategy="fsdp_full_shard", micro_batch_size=1, gpus=4, gpu_memory_gib=80, seq_len=64)
    one = carried_plan(single)
    assert single["gradient_accumulation_steps"] == one.gradient_accumulation_steps == 1
    kw = auto_args(CFG, strategy="fsdp_full_shard", micro_batch_size=1, gradient_accumulation_steps=5, gpus=4,
                   gpu_memory_gib=80, seq_len=64)  # fmt: skip
    five = carried_plan(kw)
    assert kw["gradient_accumulation_steps"] == five.gradient_accumulation_steps == 5
    assert five.global_batch_size == 1 * 5 * 4 and five.memory.grads > one.memory.grads
    refused = r"gradient_accumulation_steps=3 contradicts the plan, which accumulates 1 step\(s\) of micro-batch 1"
    with pytest.raises(ValueError, match=refused + r" \(global batch 4\); drop it, or plan with global_batch_size=12"):
        auto_args(CFG, plan=one, gradient_accumulation_steps=3)


def test_precision_flags_that_contradict_the_plan_are_refused_with_both_values():
    """bf16=False on bf16 GPUs used to pass (the run then trained fp32 activations the plan never sized); a flag equal
    to the plan's is fine."""
    assert auto_args(CFG, strategy="zero2", bf16=True, fp16=False, **GPU)["deepspeed"]["bf16"]["enabled"] is True
    with pytest.raises(ValueError, match=r"bf16=False contradicts the plan, which trains in bf16 mixed precision .*"
                       r"bf16=True, fp16=False.*Drop bf16="):  # fmt: skip
        auto_args(CFG, strategy="zero2", bf16=False, **GPU)
    with pytest.raises(
        ValueError, match=r"fp16=True contradicts the plan, which trains in fp32 .*bf16=False, fp16=False"
    ):
        auto_args(CFG, strategy="ddp", seq_len=64, global_batch_size=4, fp16=True)  # this CPU machine: fp32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"strategy": "fsdp_full_shard", "deepspeed": {"zero_optimization": {"stage": 3}}},
            r"deepspeed=.*asks for DeepSpeed but the plan's strategy is 'fsdp_full_shard'; pass strategy='zero3'",
        ),
        ({"strategy": "zero3", "fsdp": True}, r"fsdp=True asks for FSDP but the plan's strategy is 'zero3'"),
        ({"strategy": "fsdp_full_shard", "gradient_checkpointing": True}, "redundant all-gather"),
        (
            {"strategy": "ddp", "activation_checkpointing": False, "gradient_checkpointing": True},
            r"contradicts the plan, which does not checkpoint activations.*activation_checkpointing=True to auto_args",
        ),
        (
            {"strategy": "zero2", "activation_checkpointing": True, "gradient_checkpointing": False},
            r"contradicts the plan, which checkpoints activations.*activation_checkpointing=False",
        ),
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


def test_liger_kernel_follows_the_plan(tmp_path):
    liger = Hardware(device="cuda", gpus_per_node=1, gpu_memory_gib=80, bf16=True, fp16=True, liger_kernel=True)
    kwargs = auto_args(tiny_llama_config(), hardware=liger, output_dir=str(tmp_path))
    assert kwargs["use_liger_kernel"] is True  # searched and chosen: smaller and faster
    off = auto_args(tiny_llama_config(), hardware=liger, use_liger_kernel=False, output_dir=str(tmp_path))
    assert "use_liger_kernel" not in off
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        auto_args(tiny_llama_config(), gpus=2, use_liger_kernel=True, output_dir=str(tmp_path))  # CPU ranks


# One case per override that can contradict the plan: each names both sides and the fix.
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"strategy": "zero3", "deepspeed": {"zero_optimization": {"stage": 1}}},
            r"deepspeed\['zero_optimization'\]\['stage'\]=1 contradicts the plan \(zero3\), which sets .*=3\. "
            r"Pass strategy='zero1'",
        ),
        (
            {"strategy": "zero2", "deepspeed": {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}},
            r"\['offload_optimizer'\]=\{'device': 'nvme'\} contradicts the plan \(zero2\), which leaves it off.*"
            r"offload='optimizer'",
        ),
        (
            {"strategy": "zero2", "deepspeed": {"bf16": {"enabled": False}}},
            r"deepspeed\['bf16'\]\['enabled'\]=False contradicts .*=True\. Precision follows bf16=/fp16=",
        ),
        (
            {"strategy": "zero3", "deepspeed": {"zero_optimization": {"stage3_max_live_parameters": 5}}},
            r"\['stage3_max_live_parameters'\]=5 contradicts the plan \(zero3\), which sets .*=1000000000",
        ),
        ({"strategy": "zero3", "deepspeed": None}, r"deepspeed=None turns off the engine of strategy 'zero3'"),
        ({"strategy": "zero3", "deepspeed": {}}, r"deepspeed=\{\} turns off the engine of strategy 'zero3'"),
        ({"strategy": "fsdp_full_shard", "fsdp": False}, r"fsdp=False turns off .*'fsdp_full_shard'.*strategy='ddp'"),
        ({"strategy": "fsdp_full_shard", "fsdp": ""}, r"fsdp='' turns off"),
        ({"strategy": "ddp", "fsdp": True}, r"fsdp=True asks for FSDP but the plan's strategy is 'ddp'"),
        ({"strategy": "ddp", "deepspeed": {"zero_optimization": {"stage": 2}}}, r"asks for DeepSpeed .*'ddp'"),
        ({"strategy": "fsdp_full_shard", "fsdp": "shard_grad_op auto_wrap"}, r"asks for \['shard_grad_op'\]"),
        ({"strategy": "fsdp_full_shard", "fsdp": "full_shard offload"}, r"asks for CPU offload .*offload="),
        (
            {"strategy": "fsdp_full_shard", "fsdp_config": {"cpu_offload": True}},
            r"fsdp_config\['cpu_offload'\]=True contradicts the plan \(fsdp_full_shard\), which sets .*=False\. "
            r"Pass offload='optimizer\+params'",
        ),
        (
            {"strategy": "fsdp_full_shard", "fsdp_config": {"fsdp_version": 1}},
            r"fsdp_config\['version'\]=1 contradicts .*which sets fsdp_config\['version'\]=2",
        ),
        (
            {"strategy": "fsdp_full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["GPT2Block"]}},
            r"\['transformer_layer_cls_to_wrap'\]=\['GPT2Block'\] contradicts .*LlamaDecoderLayer.*wrap_classes=",
        ),
        (
            {"strategy": "fsdp_shard_grad_op", "fsdp_config": {"reshard_after_forward": True}},
            r"reshard_after_forward'\]=True contradicts .*=False",
        ),
        ({"strategy": "zero2", "fsdp_config": {"cpu_offload": False}}, r"fsdp_config=.* plan's strategy is 'zero2'"),
        ({"strategy": "zero2", "deepspeed": 3}, r"deepspeed must be a dict \(or a JSON file path\), got int 3"),
        (
            {"strategy": "fsdp_full_shard", "tp_size": 2, "parallelism_config": {"tp_size": 1}},
            r"parallelism_config tp_size=1 contradicts the plan \(fsdp_full_shard, tp_size 2\): pass tp_size= to",
        ),
        (
            {"strategy": "fsdp_full_shard", "parallelism_config": {"cp_size": 2}},
            r"parallelism_config cp_size=2 contradicts the plan \(fsdp_full_shard, cp_size 1\): pass cp_size=",
        ),
        (
            {"strategy": "zero2", "deepspeed": {"tensor_parallel": {"autotp_size": 2}}},
            r"deepspeed\['tensor_parallel'\]=\{'autotp_size': 2\} contradicts the plan \(zero2\), which leaves it "
            r"off.*Pass tp_size= to auto_args",
        ),
        (
            {"strategy": "zero2", "deepspeed": {"sequence_parallel_size": 2}},
            r"deepspeed\['sequence_parallel_size'\]=2 contradicts the plan \(zero2\).*Pass sp_size= to auto_args",
        ),
    ],
)
def test_nested_override_contradictions(kwargs, match):
    if kwargs.get("tp_size") and not installed_features().tp_distributed_config:
        pytest.skip("FSDP2 x TP with data-parallel ranks needs transformers 5.23 (refused before the merge)")
    with pytest.raises(ValueError, match=match):
        auto_args(CFG, **GPU, **kwargs)


@NEEDS_TP_LOAD
def test_parallelism_config_that_agrees_with_the_plan_is_kept():
    kw = auto_args(CFG, **GPU, strategy="fsdp_full_shard", tp_size=2, parallelism_config={"tp_size": 2})
    assert (kw["parallelism_config"].tp_size, kw["parallelism_config"].dp_shard_size) == (
        2,
        2,
    )  # 4 GPUs: tp 2 x shard 2
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match=r"parallelism_config tp_size=2 contradicts the plan \(fsdp_full_shard, tp"):
        auto_args(CFG, **GPU, strategy="fsdp_full_shard", parallelism_config=ParallelismConfig(tp_size=2))


def test_nested_overrides_merge_key_by_key(tmp_path):
    kw = auto_args(CFG, **GPU, strategy="fsdp_full_shard", fsdp=True, fsdp_config={"fsdp_limit_all_gathers": True,
                                                                                   "cpu_offload": "false"})  # fmt: skip
    cfg = kw["fsdp_config"]
    assert cfg["limit_all_gathers"] is True and cfg["version"] == 2 and cfg["state_dict_type"] == "SHARDED_STATE_DICT"
    assert cfg["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    ds_file = tmp_path / "ds.json"
    ds_file.write_text('{"zero_optimization": {"stage": 3, "round_robin_gradients": true}, "gradient_clipping": 1.0}')
    kw = auto_args(CFG, **GPU, strategy="zero3", deepspeed=str(ds_file))
    zero = kw["deepspeed"]["zero_optimization"]
    assert zero["stage"] == 3 and zero["round_robin_gradients"] is True and "reduce_bucket_size" in zero
    assert kw["deepspeed"]["gradient_clipping"] == 1.0  # "auto" in the generated config: the user's value is taken
    assert auto_args(CFG, **GPU, strategy="ddp", deepspeed=None, fsdp=False)["ddp_find_unused_parameters"] is False


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "ddp"])
def test_checkpointing_turns_the_kv_cache_off(strategy):
    """Under FSDP2 the checkpointing goes through accelerate, which transformers does not see: a cache left on is
    kept through backward (traced +100 % on Mistral 7B at 8k tokens). auto_args turns it off, as transformers does
    for its own gradient checkpointing, and leaves it alone without checkpointing."""
    import torch
    from transformers import AutoModelForCausalLM

    for checkpointing in (True, False):
        model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.bfloat16)
        assert model.config.use_cache
        auto_args(model, strategy=strategy, activation_checkpointing=checkpointing, **GPU)
        assert model.config.use_cache is not checkpointing


def test_a_cpu_launch_of_several_ranks_trains_as_one_job(monkeypatch):
    """torchrun / accelerate launch without CUDA: transformers trains each rank alone unless use_cpu=True (what
    ACCELERATE_USE_CPU=1 sets); auto_args says so for DDP (and an opted-in FSDP), and never pins memory without
    CUDA."""
    assert "use_cpu" not in auto_args(CFG, strategy="ddp", **GPU)  # one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    kw = auto_args(CFG, strategy="ddp", **GPU)
    assert kw["use_cpu"] is True and kw["dataloader_pin_memory"] is True  # planned for GPUs: pinned
    assert auto_args(CFG, strategy="ddp", gpus=2)["dataloader_pin_memory"] is False  # CPU ranks
    assert auto_args(CFG, strategy="ddp", use_cpu=False, **GPU)["use_cpu"] is False  # the user's value wins


def test_fsdp_or_zero_on_cpu_ranks_is_refused_naming_the_call_that_runs_it(monkeypatch):
    """accelerate drops FSDP on CPU ranks (plain DDP trains) and sets DeepSpeed up for one rank there: auto_args
    refuses both, naming auto_args(..., engine_on_cpu=True), which turns the engine on (the CPU setup itself is
    hf_dist.runtime.cpu_fsdp's, recorded here: it would patch accelerate and start a process group)."""
    from hf_dist.runtime import cpu_fsdp

    calls = []
    monkeypatch.setattr(cpu_fsdp, "enable_fsdp_on_cpu", lambda: calls.append("fsdp"))
    ds_kwargs = {"use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    monkeypatch.setattr(cpu_fsdp, "cpu_deepspeed_training_kwargs", lambda: calls.append("zero") or dict(ds_kwargs))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, recipe_flag in (("fsdp_full_shard", "--fsdp_on_cpu"), ("zero2", "--deepspeed_on_cpu")):
        call = r"hf_dist\.auto_args\(model, \.\.\., engine_on_cpu=True\)"
        with pytest.raises(ValueError, match=rf"strategy '{name}' on 2 CPU ranks: .*call {call}.*pass {recipe_flag}"):
            auto_args(CFG, strategy=name, **GPU)
    assert calls == []  # refused before anything was switched on
    assert auto_args(CFG, strategy="fsdp_full_shard", engine_on_cpu=True, **GPU)["use_cpu"] is True
    kw = auto_args(CFG, strategy="zero2", engine_on_cpu=True, accelerator_config={"even_batches": False}, **GPU)
    assert calls == ["fsdp", "zero"] and kw["use_cpu"] is False
    assert kw["accelerator_config"] == {"even_batches": False, "use_configured_state": True}
    assert auto_args(CFG, strategy="ddp", engine_on_cpu=True, **GPU)["use_cpu"] is True and len(calls) == 2
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: nothing to turn on, nothing refused
    assert "use_cpu" not in auto_args(CFG, strategy="zero2", engine_on_cpu=True, **GPU) and len(calls) == 2


def test_deepspeeds_deprecated_gather_warning_is_shown_once():
    import warnings

    message = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use all_gather_single instead."
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        auto_args(CFG, strategy="zero3", **GPU)  # installs the filter for a DeepSpeed plan
        for line in range(3):  # three call sites, as ZeRO-3's gathers are
            warnings.warn_explicit(message, FutureWarning, "deepspeed/comm/torch.py", 100 + line)
    assert sum(message in str(w.message) for w in seen) == 1


def test_every_contradiction_is_reported_at_once(monkeypatch):
    """auto_args validates once: six contradictions of six kinds come back in one error, each with its fix, and
    nothing was applied to the model before it (the check runs before the model is touched)."""
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "zero_stage")
    with pytest.raises(ValueError) as caught:
        auto_args(
            CFG,
            strategy="zero3",
            per_device_train_batch_size=1,
            micro_batch_size=2,  # 1. the same thing twice, two values
            gradient_accumulation_steps=3,  # 2. 1 x 3 x 4 ranks != 16
            deepspeed={"zero_optimization": {"stage": 2}},  # 3. another stage than the plan's
            fp16=True,  # 4. against the plan's bf16
            optim="sgd",  # 5. against the plan's AdamW
            **GPU,
        )  # 6. the launcher's DeepSpeed fields clash with the JSON
    problems = caught.value.problems
    assert len(problems) == 6, problems
    for pattern in (
        r"micro_batch_size \(2\) != per_device_train_batch_size \(1\)",
        r"gradient_accumulation_steps\(3\) \* world_size\(4\) = 12 != global_batch_size\(16\)",
        r"\['zero_optimization'\]\['stage'\]=2 contradicts the plan \(zero3\)",
        r"fp16=True contradicts the plan, which trains in bf16 mixed precision .*bf16=True, fp16=False",
        r"optim='sgd' contradicts the plan's optimizer 'adamw' \(optim='adamw_torch_fused'\)",
        r"launched with an accelerate DeepSpeed config that sets \['zero_stage'\]",
    ):
        assert sum(bool(re.search(pattern, p)) for p in problems) == 1, (pattern, problems)
    assert str(caught.value).startswith("auto_args: 6 contradictions, fix them all:\n  1. ")


@NEEDS_TP_LOAD
def test_batch_math_counts_data_parallel_ranks_under_tensor_parallelism():
    """With tp_size 2 on 8 ranks, 4 ranks take distinct micro-batches: the plan's own accumulation steps are accepted,
    one that misses the global batch is refused in those terms, and lr_scaling scales to the real global batch."""
    tp = dict(GPU, gpus=8, strategy="fsdp_full_shard", tp_size=2)
    planned = auto_args(CFG, **tp)
    mbs, gas = planned["per_device_train_batch_size"], planned["gradient_accumulation_steps"]
    assert mbs * gas * 4 == 16
    assert auto_args(CFG, **tp, gradient_accumulation_steps=gas)["gradient_accumulation_steps"] == gas
    with pytest.raises(ValueError, match=rf"\* data_parallel\(4\) = {mbs * 2 * gas * 4} != global_batch_size\(16\)"):
        auto_args(CFG, **tp, gradient_accumulation_steps=2 * gas)
    scaled = auto_args(CFG, **tp, lr_scaling="linear", reference_batch_size=8, learning_rate=1e-4)
    assert scaled["learning_rate"] == pytest.approx(1e-4 * 16 / 8)  # the global batch is 16, not 16 x tp


def test_sync_each_batch_is_emitted_so_the_trainer_runs_it(tmp_path):
    """A plan that reduce-scatters every micro-batch becomes accelerator_config.gradient_accumulation_kwargs
    (accelerate's GradientAccumulationPlugin, which the Trainer builds and reads before each no_sync)."""
    kw = auto_args(CFG, strategy="fsdp_full_shard", micro_batch_size=2, sync_each_batch=True, **GPU)
    assert kw["gradient_accumulation_steps"] == 2
    assert kw["accelerator_config"] == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    args = build(tmp_path, use_cpu=True, **kw)
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
    assert "accelerator_config" not in auto_args(CFG, strategy="fsdp_full_shard", micro_batch_size=2, **GPU)
    merged = auto_args(CFG, strategy="fsdp_full_shard", micro_batch_size=2, sync_each_batch=True,
                       accelerator_config={"split_batches": False}, **GPU)  # fmt: skip
    assert merged["accelerator_config"] == {
        "split_batches": False, "gradient_accumulation_kwargs": {"sync_each_batch": True}}  # fmt: skip
    against = {"gradient_accumulation_kwargs": {"sync_each_batch": False}}
    with pytest.raises(ValueError, match=r"accelerator_config gradient_accumulation_kwargs sync_each_batch=False "
                                         r"contradicts the plan \(fsdp_full_shard, sync_each_batch=True\).*pass "
                                         r"sync_each_batch=False to auto_args"):  # fmt: skip
        auto_args(CFG, strategy="fsdp_full_shard", micro_batch_size=2, sync_each_batch=True,
                  accelerator_config=against, **GPU)  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown sync_each_batch .yes.; allowed: False, True"):
        auto_args(CFG, strategy="fsdp_full_shard", sync_each_batch="yes", **GPU)


def test_a_peft_models_lora_and_peft_config_are_what_auto_args_plans():
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(CFG)
    model = peft.get_peft_model(base, peft.LoraConfig(r=64, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"lora_rank=16 but the PeftModel's config has 64"):
        auto_args(model, lora_rank=16, **GPU)
    with pytest.raises(ValueError, match=r"peft_config is a IA3 adapter.*hf_dist plans LoRA adapters only"):
        auto_args(CFG, peft_config=peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]), **GPU)
    kw = auto_args(CFG, peft_config=peft.LoraConfig(r=8, target_modules=["q_proj"]), **GPU)
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] * 4 == 16
