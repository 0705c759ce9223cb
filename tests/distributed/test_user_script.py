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
