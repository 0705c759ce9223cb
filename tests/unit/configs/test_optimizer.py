"""auto_args(optimizer=...) sets the Trainer's optim= to the optimizer the plan sized; an optim= or a layout under
which another optimizer would step is refused with both values (hf_dist.configs.optimizer, through configs/validate)."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from hf_dist.auto import auto_args
from hf_dist.configs.optimizer import OPTIM_NAMES, optimizer_of_optim, trainer_optim
from hf_dist.planning.features import LibraryFeatures, installed_features
from hf_dist.planning.memory import OPTIMIZERS
from hf_dist.runtime.planned import carried_plan
from hf_dist.testing import tiny_llama_config

CFG = tiny_llama_config()
GPU = dict(gpus=4, gpu_memory_gib=80, seq_len=64, global_batch_size=16)


def test_every_planned_optimizer_has_a_trainer_optim_that_transformers_knows():
    assert set(OPTIM_NAMES) == set(OPTIMIZERS)
    for names in OPTIM_NAMES.values():
        assert all(OptimizerNames(name) for name in names)
    assert installed_features().default_adamw == TrainingArguments.optim  # what the Trainer runs by default
    assert trainer_optim("adamw", LibraryFeatures(default_adamw="adamw_torch")) == "adamw_torch"
    with pytest.raises(
        ValueError, match=r"optimizer 'lion' has no Trainer optim= .* \['adamw', 'adamw_8bit', 'sgd'\]"
    ):
        trainer_optim("lion", installed_features())
    assert optimizer_of_optim(OptimizerNames.ADAMW_8BIT) == "adamw_8bit" and optimizer_of_optim("adafactor") is None


@pytest.mark.parametrize(
    "optimizer, optim",
    [("adamw", installed_features().default_adamw), ("adamw_8bit", "adamw_bnb_8bit"), ("sgd", "sgd")],
)
def test_auto_args_sets_optim_to_the_planned_optimizer(tmp_path, optimizer, optim):
    kwargs = auto_args(CFG, strategy="fsdp_full_shard", optimizer=optimizer, **GPU)
    assert kwargs["optim"] == optim and carried_plan(kwargs).optimizer == optimizer
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert optimizer_of_optim(args.optim) == optimizer


def test_an_optim_that_runs_the_planned_optimizer_is_accepted():
    assert auto_args(CFG, strategy="ddp", optim="adamw_torch", **GPU)["optim"] == "adamw_torch"
    assert auto_args(CFG, strategy="ddp", optimizer="adamw_8bit", optim="adamw_8bit", **GPU)["optim"] == "adamw_8bit"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"optimizer": "adamw_8bit", "optim": "adamw_torch_fused"},
            r"optim='adamw_torch_fused' contradicts the plan's optimizer 'adamw_8bit' \(optim='adamw_bnb_8bit'\)",
        ),
        (
            {"optim": "adafactor"},
            r"optim='adafactor' contradicts the plan's optimizer 'adamw'.*hf_dist plans adamw \(adamw_torch_fused/"
            r"adamw_torch\), adamw_8bit \(adamw_bnb_8bit/adamw_8bit\), sgd \(sgd\); pass optimizer=",
        ),
        (
            {"optimizer": "adamw_8bit", "strategy": "zero3", "offload": "optimizer"},
            r"optimizer='adamw_8bit' with offload='optimizer': bitsandbytes' 8-bit AdamW steps on a CUDA GPU",
        ),
        (
            {"optimizer": "sgd", "strategy": "zero2", "offload": "optimizer"},
            r"optimizer='sgd' with zero2 offload='optimizer': accelerate replaces .* DeepSpeedCPUAdam.*cpu_adam=False",
        ),
    ],
)
def test_an_optimizer_the_trainer_would_not_run_as_planned_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        auto_args(CFG, **GPU, **kwargs)


def test_sgd_with_zero_offload_keeps_torch_sgd_with_cpu_adam_false():
    kwargs = auto_args(CFG, strategy="zero2", offload="optimizer", optimizer="sgd", cpu_adam=False, **GPU)
    assert kwargs["optim"] == "sgd" and kwargs["deepspeed"]["zero_force_ds_cpu_optimizer"] is False


def test_8bit_adamw_on_cpu_hardware_is_refused():
    with pytest.raises(ValueError, match=r"optimizer='adamw_8bit' with CPU hardware: bitsandbytes' 8-bit AdamW"):
        auto_args(CFG, optimizer="adamw_8bit", seq_len=16, global_batch_size=2)
