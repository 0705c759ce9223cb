"""A user's own script (README "Use it in your own script") on 2 CPU ranks asks for FSDP2 or ZeRO-3 with
``auto_args(model, strategy=...)`` alone and gets it or a refusal naming the exact call, never a silent DDP run.

Each strategy is one plain ``torchrun`` launch of ``scripts/user_script_train.py`` (no ``ACCELERATE_USE_CPU``, no
``HF_DIST_FSDP_ON_CPU``), cached per session (conftest ``user_script_runs``). Before this, the FSDP script trained
DDP and saved ``model.safetensors`` + ``optimizer.pt``, ``attach(trainer)`` noticed nothing, and ZeRO-3 failed with
a hint naming a call auto_args had not made.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

NAMED_CALL = "hf_dist.auto_args(model, ..., engine_on_cpu=True)"


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "zero3"])
def test_the_readme_call_alone_is_refused_naming_the_call_that_runs_the_engine(user_script_runs, strategy):
    refusal = user_script_runs.get(strategy)["refusal"]
    assert refusal is not None, "auto_args returned kwargs for an engine accelerate would not run on CPU ranks"
    assert refusal.startswith(f"strategy '{strategy}' on 2 CPU ranks: ") and NAMED_CALL in refusal, refusal


@pytest.mark.parametrize("strategy", ["fsdp_full_shard", "zero3"])
def test_the_named_call_trains_the_planned_engine_checked_by_attach_alone(user_script_runs, strategy):
    report = user_script_runs.get(strategy)
    assert report["plan_checked"] and report["plan_strategy"] == strategy and report["mismatches"] == []
    assert report["world_size"] == 2 and report["global_step"] == 2 and len(report["losses"]) == 2
    assert report["optimizer"] == "adamw"
    files = report["checkpoint_files"]
    assert "checkpoint-2/optimizer.pt" not in files, files  # DDP's whole optimizer state in one file
    if strategy == "fsdp_full_shard":
        assert report["distributed_type"] == "FSDP" and report["model_wrapped"] == "FSDPLlamaForCausalLM"
        assert {"checkpoint-2/pytorch_model_fsdp_0/.metadata", "checkpoint-2/optimizer_0/.metadata"} <= set(files)
    else:
        assert report["distributed_type"] == "DEEPSPEED" and report["model_wrapped"] == "DeepSpeedEngine"
        assert report["zero_stage"] == 3
        assert any(f.startswith("checkpoint-2/global_step2/zero_pp_rank_1") for f in files), files


# Issue 39: what a user's own script gets wrong under FSDP2, run by the same launch after its training (the script's
# lora_run / other_model_resume), each refused by attach(trainer) alone.


def test_an_unseeded_lora_under_fsdp2_is_refused_naming_the_seed(user_script_runs):
    refusal = user_script_runs.get("fsdp_full_shard")["lora_unseeded"]["refusal"]
    assert refusal is not None, "attach let ranks with different adapters train"
    assert refusal.startswith("the 2 ranks hold different trainable parameters (") and "\n" not in refusal, refusal
    assert "FSDP2 would shard and train a mix of them" in refusal and "set_seed(SEED) before get_peft_model" in refusal


def test_the_refusal_is_no_false_alarm_fsdp2_trains_a_mix_of_the_ranks_adapters(user_script_runs):
    """Control: the same run with the check switched off trains an adapter that is not rank 0's (nor, by the same
    reasoning, any one rank's): each rank kept its own slice."""
    control = user_script_runs.get("fsdp_full_shard")["lora_unseeded_unchecked"]
    assert control["refusal"] is None and control["global_step"] == 2
    assert control["kept"] is False


def test_with_rank_0s_weights_broadcast_the_unseeded_lora_is_rank_0s_and_trains(user_script_runs):
    """auto_args' default cpu_ram_efficient_loading: accelerate sends rank 0's weights to every rank, so the ranks'
    difference is harmless and attach does not check it."""
    run = user_script_runs.get("fsdp_full_shard")["lora_unseeded_broadcast"]
    assert run["refusal"] is None and run["kept"] is True and run["global_step"] == 2


def test_the_same_lora_seeded_trains_rank_0s_adapter(user_script_runs):
    seeded = user_script_runs.get("fsdp_full_shard")["lora_seeded"]
    assert seeded["refusal"] is None and seeded["kept"] is True
    assert seeded["global_step"] == 2 and len(seeded["losses"]) == 2


def test_resuming_another_models_checkpoint_is_refused_naming_both(user_script_runs):
    report = user_script_runs.get("fsdp_full_shard")
    refusal = report["other_model_resume"]
    assert (
        refusal is not None
        and refusal.startswith("cannot resume ")
        and "checkpoint-2: it holds another model (hidden_size " in refusal
    ), refusal
    assert "than the one being trained (hidden_size " in refusal and "\n" not in refusal


def test_an_fsdp2_checkpoint_carries_the_config_and_converts_without_model_config(user_script_runs, tmp_path):
    from pathlib import Path

    import hf_dist

    report = user_script_runs.get("fsdp_full_shard")
    files = set(report["checkpoint_files"])
    assert {"checkpoint-2/config.json", "checkpoint-2/generation_config.json"} <= files, sorted(files)
    checkpoint = Path(report["workdir"]) / "run" / "checkpoint-2"
    converted = hf_dist.convert(checkpoint, tmp_path / "hf", progress=False)  # the README's line, no --model-config
    assert (tmp_path / "hf" / "config.json").is_file() and converted.num_tensors > 0
