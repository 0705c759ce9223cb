"""A bf16-loaded model trained through ``auto_args()`` ends up with the optimizer-state dtype the plan states.

One 2-rank run per strategy (tests/distributed/scripts/precision_train.py, in the launch of its engine's
runs in test_strategies.py: conftest ``strategy_runs``) trains the same
bf16-loaded tiny Llama twice under the HF Trainer with bf16 mixed precision: by default and with
``pure_bf16=True``. The report holds what the real innermost torch optimizer holds after two steps: the
dtype of the tensors it steps (the master weights) and of Adam's ``exp_avg`` / ``exp_avg_sq``.

* default: fp32 masters and fp32 Adam state under every strategy: auto_args upcast the model for DDP
  (one warning), accelerate upcast the FSDP2 shards, DeepSpeed kept an fp32 partition (the engine's
  module stays bf16);
* pure bf16: bf16 masters and bf16 Adam state, the model never upcast.

Without the fix, the DDP default run holds bf16 Adam state: the test fails there.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed.conftest import PRECISION_STRATEGIES as STRATEGIES

pytestmark = pytest.mark.distributed

MODES = {"default": "float32", "pure_bf16": "bfloat16"}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optimizer_state_dtype_is_what_the_plan_states(strategy_runs, strategy):
    report = strategy_runs.get(f"precision_{strategy}")
    assert report["world_size"] == 2
    for mode, expected in MODES.items():
        run = report[mode]
        assert run["plan_model_dtype"] == "bfloat16"
        assert run["plan_pure_bf16"] is (mode == "pure_bf16")
        assert run["plan_optimizer_state_dtype"] == expected
        assert run["stepped_tensors"] > 0, f"{strategy}/{mode}: the optimizer holds no Adam state"
        facts = {k: run[k] for k in ("master_dtypes", "exp_avg_dtypes", "exp_avg_sq_dtypes")}
        assert facts == dict.fromkeys(facts, [expected]), f"{strategy}/{mode}: {facts} ({run['optimizer_chain']})"
        assert len(run["losses"]) == 2 and all(math.isfinite(x) for x in run["losses"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_strategy_really_ran_with_the_planned_precision(strategy_runs, strategy):
    report = strategy_runs.get(f"precision_{strategy}")
    default, pure = report["default"], report["pure_bf16"]
    if strategy == "ddp":
        assert default["model_wrapped"] == pure["model_wrapped"] == "DistributedDataParallel"
        assert default["param_dtypes_after_auto_args"] == ["float32"]
        assert len(default["upcast_warnings"]) == 1, default["upcast_warnings"]
        assert "pure_bf16=True" in default["upcast_warnings"][0]
        assert pure["param_dtypes_after_auto_args"] == pure["wrapped_param_dtypes"] == ["bfloat16"]
    elif strategy.startswith("fsdp"):
        assert default["distributed_type"] == pure["distributed_type"] == "FSDP"
        assert default["model_wrapped"] == "FSDPLlamaForCausalLM"
        # FSDP2's sharded parameters are the optimizer's tensors: accelerate upcasts only when mixed precision is on
        assert (default["accelerate_mixed_precision"], default["wrapped_param_dtypes"]) == ("bf16", ["float32"])
        assert (pure["accelerate_mixed_precision"], pure["wrapped_param_dtypes"]) == ("no", ["bfloat16"])
    else:
        stage = int(strategy[-1])
        assert default["zero_stage"] == pure["zero_stage"] == stage
        assert default["wrapped_param_dtypes"] == pure["wrapped_param_dtypes"] == ["bfloat16"]
        assert pure["deepspeed_bf16"]["bf16_optimizer_states"] is True
    for run in (default, pure):
        if strategy != "ddp":
            assert run["upcast_warnings"] == [], "only DDP / one process needs auto_args to upcast"
