"""``attach(trainer)`` alone checks the live run against the plan ``auto_args`` made (``hf_dist.runtime.planned``):
a real single-process Trainer on a tiny Llama, its arguments built from ``auto_args``' kwargs as a user script builds
them."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import hf_dist
from hf_dist.callbacks import PlanCallback, attach
from hf_dist.callbacks.plan import PlanMismatchError
from hf_dist.runtime.planned import forget, last_plan
from hf_dist.testing import TokenDataset, tiny_llama_config

PLAN = dict(seq_len=16, global_batch_size=2)  # this CPU machine, one process: DDP, micro-batch 2, fp32


def trainer_of(kwargs: dict, tmp_path, *, args_class=TrainingArguments, **trainer_kwargs) -> Trainer:
    """A Trainer whose arguments are ``args_class(output_dir=..., **kwargs)`` plus a one-step run."""
    run = dict(output_dir=str(tmp_path / "out"), max_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
    args = args_class(**{**run, **kwargs})
    return Trainer(model=trainer_kwargs.pop("model"), args=args, train_dataset=TokenDataset(8), **trainer_kwargs)


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def plan_check(callbacks: list) -> PlanCallback | None:
    return next((cb for cb in callbacks if isinstance(cb, PlanCallback)), None)


def test_attach_alone_refuses_precision_flags_the_plan_did_not_size(tmp_path):
    """attach(trainer) used to check nothing without plan=: it now finds the plan auto_args made."""
    m = model()
    kwargs = hf_dist.auto_args(m, **PLAN)  # fp32 on this CPU machine
    trainer = trainer_of({**kwargs, "bf16": True, "use_cpu": True}, tmp_path, model=m)
    attach(trainer)
    with pytest.raises(PlanMismatchError, match=r"mixed precision: planned no, running bf16"):
        trainer.train()


def test_no_plan_without_auto_args_and_none_with_plan_false(tmp_path):
    m = model()
    forget()
    assert plan_check(attach(trainer_of({}, tmp_path, model=m))) is None  # a Trainer built without auto_args
    kwargs = hf_dist.auto_args(m, **PLAN)
    assert plan_check(attach(trainer_of(kwargs, tmp_path, model=m), plan=False)) is None
    mine = hf_dist.plan(m, **PLAN)
    assert plan_check(attach(trainer_of(kwargs, tmp_path, model=m), plan=mine)).plan is mine
    with pytest.raises(ValueError, match="bf16=True and fp16=True are both set"):
        hf_dist.auto_args(m, bf16=True, fp16=True, **PLAN)
    assert last_plan() is None  # a refused call leaves no plan to check against
