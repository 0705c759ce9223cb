"""``attach(trainer)`` alone checks the live run against the plan ``auto_args`` put into its kwargs
(``hf_dist.runtime.planned``):
a real single-process Trainer on a tiny Llama, its arguments built from ``auto_args``' kwargs as a user script builds
them. What it checks beyond the batch and the engine: the optimizer that really steps, the precision flags and the
sequence length of arguments that truncate (TRL's ``max_length``)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import hf_dist
from hf_dist.callbacks import PlanCallback, attach
from hf_dist.callbacks.plan import PlanMismatchError, running_optimizer
from hf_dist.runtime.planned import carried_plan
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


def test_attach_alone_checks_the_plan_auto_args_made_and_the_planned_optimizer_runs(tmp_path):
    """auto_args(optimizer="sgd") used to plan SGD while the Trainer ran fused AdamW, and attach(trainer) checked
    nothing without plan=: now optim= is the planned optimizer and attach finds the plan by itself."""
    m = model()
    kwargs = hf_dist.auto_args(m, optimizer="sgd", **PLAN)
    assert kwargs["optim"] == "sgd"
    trainer = trainer_of(kwargs, tmp_path, model=m)
    check = plan_check(attach(trainer))
    assert check is not None and check.plan is carried_plan(kwargs) and check.plan.optimizer == "sgd"
    trainer.train()
    assert check.mismatches == [] and trainer.state.global_step == 1
    assert running_optimizer(trainer.optimizer) == "sgd" and type(trainer.optimizer.optimizer) is torch.optim.SGD


def test_attach_alone_refuses_an_optimizer_the_plan_did_not_size(tmp_path):
    """optim= changed behind auto_args' back, or an optimizer handed to the Trainer: what steps is checked."""
    m = model()
    kwargs = hf_dist.auto_args(m, **PLAN)  # AdamW, the Trainer's default optim
    assert kwargs["optim"] == TrainingArguments.optim
    trainer = trainer_of({**kwargs, "optim": "sgd"}, tmp_path, model=m)
    attach(trainer)
    with pytest.raises(
        PlanMismatchError, match=r"optimizer: planned adamw, running sgd\n    fix: pass auto_args' optim"
    ):
        trainer.train()
    assert trainer.state.global_step == 0  # refused before the first step
    own = trainer_of(kwargs, tmp_path, model=m, optimizers=(torch.optim.SGD(m.parameters(), lr=0.1), None))
    attach(own)
    with pytest.raises(PlanMismatchError, match=r"optimizer: planned adamw, running sgd"):
        own.train()


def test_attach_alone_refuses_precision_flags_the_plan_did_not_size(tmp_path):
    m = model()
    kwargs = hf_dist.auto_args(m, **PLAN)  # fp32 on this CPU machine
    trainer = trainer_of({**kwargs, "bf16": True, "use_cpu": True}, tmp_path, model=m)
    attach(trainer)
    with pytest.raises(PlanMismatchError, match=r"mixed precision: planned no, running bf16"):
        trainer.train()


def test_no_plan_without_auto_args_and_none_with_plan_false(tmp_path, monkeypatch):
    m = model()
    assert plan_check(attach(trainer_of({}, tmp_path, model=m))) is None  # a Trainer built without auto_args
    kwargs = hf_dist.auto_args(m, **PLAN)
    assert plan_check(attach(trainer_of(kwargs, tmp_path, model=m), plan=False)) is None
    mine = hf_dist.plan(m, **PLAN)
    assert plan_check(attach(trainer_of(kwargs, tmp_path, model=m), plan=mine)).plan is mine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="strategy 'fsdp_full_shard' on 2 CPU ranks"):
        hf_dist.auto_args(m, strategy="fsdp_full_shard", **PLAN)


def test_each_trainer_checks_the_plan_its_own_arguments_carry(tmp_path):
    """Two runs planned in one process: each Trainer is checked against the plan of the kwargs it was built from, not
    the last one made. The plan survives the copies transformers and TRL make of the arguments, and pickles
    (``training_args.bin``) as a plain dict that names it, with no hf_dist class in the file."""
    import copy
    import pickle

    m = model()
    sgd, adamw = hf_dist.auto_args(m, optimizer="sgd", **PLAN), hf_dist.auto_args(m, optimizer="adamw", **PLAN)
    first, second = trainer_of(sgd, tmp_path, model=m), trainer_of(adamw, tmp_path, model=m)
    assert plan_check(attach(second)).plan.optimizer == "adamw"
    check = plan_check(attach(first))
    assert check.plan.optimizer == "sgd"
    first.train()
    assert check.mismatches == [] and running_optimizer(first.optimizer) == "sgd"
    args = first.args
    assert carried_plan(copy.deepcopy(args)) is carried_plan(copy.copy(args)) is carried_plan(args) is check.plan
    assert carried_plan(TrainingArguments(**args.to_dict())) is check.plan  # TRL converts arguments this way
    data = pickle.dumps(args)
    assert b"hf_dist" not in data.replace(b"hf_dist_plan", b"")
    stored = pickle.loads(data).fsdp_config["hf_dist_plan"]
    assert type(stored) is dict and stored["micro_batch_size"] == 2 and carried_plan(pickle.loads(data)) is None
    assert '"hf_dist_plan": {' in args.to_json_string()  # print(args) and the loggers show the plain dict


def test_trl_max_length_is_checked_against_the_planned_seq_len(tmp_path):
    """SFTConfig(**auto_args(..., seq_len=16)) without config_class= keeps TRL's max_length=1024: refused at train
    start. With config_class=SFTConfig auto_args emits max_length=16 and the run trains."""
    trl = pytest.importorskip("trl", reason="the trl extra (hf_dist[trl]) is not installed in this environment")
    m = model()
    plain = trainer_of(hf_dist.auto_args(m, **PLAN), tmp_path, model=m, args_class=trl.SFTConfig)
    assert plain.args.max_length == 1024
    attach(plain)
    with pytest.raises(
        PlanMismatchError, match=r"sequence length: planned 16, running 1024\n    fix: pass config_class="
    ):
        plain.train()
    kwargs = hf_dist.auto_args(m, config_class=trl.SFTConfig, **PLAN)
    planned = trainer_of(kwargs, tmp_path, model=m, args_class=trl.SFTConfig)
    check = plan_check(attach(planned))
    planned.train()
    assert planned.args.max_length == 16 and check.mismatches == [] and planned.state.global_step == 1


def test_the_running_optimizer_is_read_through_its_wrappers():
    """accelerate's and DeepSpeed's wrappers hold the optimizer that steps in .optimizer; DeepSpeed's CPU Adam and
    bitsandbytes' 8-bit AdamW are named as the plan names them."""
    from types import SimpleNamespace

    param = torch.nn.Parameter(torch.zeros(1))
    wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=torch.optim.AdamW([param])))
    assert running_optimizer(wrapped) == "adamw"
    assert running_optimizer(type("DeepSpeedCPUAdam", (), {})()) == "adamw"
    bnb = type("AdamW", (), {"__module__": "bitsandbytes.optim.adamw"})
    eight_bit = bnb()
    eight_bit.args = SimpleNamespace(optim_bits=8)
    assert running_optimizer(eight_bit) == "adamw_8bit"
    assert running_optimizer(torch.optim.Adagrad([param])) == "Adagrad"
    assert running_optimizer(None, SimpleNamespace(optim="adamw_bnb_8bit")) == "adamw_8bit"
    assert running_optimizer(None, SimpleNamespace(optim="adafactor")) == "adafactor"


def test_every_call_a_plan_check_hint_names_exists(monkeypatch):
    """The fixes the plan check prints name auto_args keywords, TrainingArguments fields and hf_dist functions: each
    must exist (a hint once named a call auto_args had not made)."""
    import dataclasses
    import importlib
    import re
    from types import SimpleNamespace

    from hf_dist.callbacks.plan import _FIXES, check_launch
    from hf_dist.configs.request import CONFIG_KEYS, PLAN_KEYS

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanMismatchError) as launch:
        check_launch(SimpleNamespace(world_size=1, output_dir="out"))
    text = " ".join([*_FIXES.values(), str(launch.value)])
    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    keywords = set(re.findall(r"(?<![\w.-])([a-z][a-z_]*)=", text)) - {"optimizers"}  # the Trainer's own keyword
    assert keywords and keywords <= set(PLAN_KEYS) | set(CONFIG_KEYS) | fields, keywords - set(PLAN_KEYS) - fields
    assert "engine_on_cpu" in keywords
    for dotted in set(re.findall(r"hf_dist\.[\w.]+[\w]", text)):
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name), dotted


def test_a_users_wrap_classes_are_recorded_in_the_plan_and_attach_checks_against_them(tmp_path, monkeypatch):
    """``auto_args(wrap_classes=[...])`` emitted the user's classes, but attach compared the live run with classes
    detected afresh in the model, so a run exactly as planned was refused. The plan now records what was emitted;
    the live side is what accelerate's FSDP plugin reads from the emitted ``fsdp_config``."""
    from transformers import TrainerState

    from hf_dist.runtime import dist

    m = model()
    users = ["LlamaMLP", "LlamaDecoderLayer"]
    kwargs = hf_dist.auto_args(m, strategy="fsdp_full_shard", wrap_classes=users, engine_on_cpu=True, **PLAN)
    emitted = kwargs["fsdp_config"]["transformer_layer_cls_to_wrap"]
    assert emitted == users and carried_plan(kwargs).wrap_classes == users
    monkeypatch.setattr(dist, "live_wrap_classes", lambda: sorted(emitted))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    check = PlanCallback(carried_plan(kwargs), strict=False)
    check.on_train_begin(args, TrainerState(is_world_process_zero=False), control=None, model=m)
    assert not [x for x in check.mismatches if x.startswith("FSDP wrap classes")], check.mismatches
    detected = PlanCallback(hf_dist.plan(m, strategy="fsdp_full_shard", **PLAN), strict=False)  # no auto_args
    detected.on_train_begin(args, TrainerState(is_world_process_zero=False), control=None, model=m)
    assert "FSDP wrap classes: planned ['LlamaDecoderLayer'], running ['LlamaDecoderLayer', 'LlamaMLP']" in (
        detected.mismatches
    )
