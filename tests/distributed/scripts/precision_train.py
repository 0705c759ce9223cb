"""Train a bf16-loaded tiny Llama through ``auto_args()`` twice (default, then ``pure_bf16=True``) and record dtypes.

Launched by tests/distributed/test_precision.py, e.g.::

    torchrun --nproc_per_node 2 tests/distributed/scripts/precision_train.py --strategy ddp --out ddp.json
    HF_DIST_FSDP_ON_CPU=1 torchrun --nproc_per_node 2 tests/distributed/scripts/precision_train.py \
        --strategy fsdp_full_shard --out fsdp.json

Both runs share one launch (imports and the process group dominate its cost): the accelerate state is
reset between them. The plan is made for this CPU described as bf16-capable (``detect_hardware(bf16=True)``),
so ``auto_args`` returns bf16 mixed precision. After two optimizer steps rank 0 writes, per mode, the
plan's stated optimizer-state dtype and what the real optimizer holds: the dtype of the tensors the
optimizer steps (master weights: the model's parameters for DDP/FSDP2, DeepSpeed's flat partitions)
and of Adam's ``exp_avg`` / ``exp_avg_sq``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs, enable_fsdp_on_cpu_from_env
from hf_dist.runtime.dist import shutdown

SEED = 1234
SEQ_LEN = 16
STEPS = 2
MICRO_BATCH = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", required=True, help="an hf_dist strategy (ddp, fsdp_full_shard, zero1...)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--out", required=True, help="JSON report written by rank 0")
    return parser.parse_args(argv)


def build_model():
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.bfloat16)


class LogCounter(logging.Handler):
    """Counts hf_dist warnings that say parameters were upcast."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def optimizer_facts(trainer) -> dict:
    """The innermost torch optimizer (under accelerate's and DeepSpeed's wrappers) and its state dtypes."""
    opt, chain = trainer.optimizer, []
    while getattr(opt, "optimizer", None) is not None:
        chain.append(type(opt).__name__)
        opt = opt.optimizer
    chain.append(type(opt).__name__)
    # keys of the state, not param_groups: ZeRO-3 puts its fp32 (or bf16) partition into the param group only
    # for the duration of step()
    states = [(p, s) for p, s in opt.state.items() if "exp_avg" in s]
    return {
        "optimizer_chain": chain,
        "master_dtypes": dtypes(p for p, _ in states),
        "exp_avg_dtypes": dtypes(s["exp_avg"] for _, s in states),
        "exp_avg_sq_dtypes": dtypes(s["exp_avg_sq"] for _, s in states),
        "stepped_tensors": len(states),
    }


def allow_bf16_on_cpu_deepspeed() -> None:
    """DeepSpeed on CPU needs ``use_cpu=False`` (cpu_fsdp.cpu_deepspeed_training_kwargs), and ``TrainingArguments``
    then refuses ``bf16=True`` unless a GPU supports it. DeepSpeed's CPU accelerator trains bf16
    (``CPU_Accelerator.is_bf16_supported()`` is True), so the GPU check is answered for it."""
    import transformers.training_args

    transformers.training_args.is_torch_bf16_gpu_available = lambda: True


def run(strategy: str, pure_bf16: bool, output_dir: str, world_size: int) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_dist
    from hf_dist.planning.hardware import detect_hardware

    model = build_model()
    handler = LogCounter()
    logging.getLogger("hf_dist").addHandler(handler)
    planner = dict(
        strategy=strategy, seq_len=SEQ_LEN, hardware=detect_hardware(gpus=world_size, bf16=True), pure_bf16=pure_bf16
    )
    plan = hf_dist.plan(model, micro_batch_size=MICRO_BATCH, **planner)  # what auto_args plans, for the report
    auto = hf_dist.auto_args(
        model, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=1, engine_on_cpu=True, **planner
    )
    logging.getLogger("hf_dist").removeHandler(handler)
    param_dtypes_after_auto_args = dtypes(model.parameters())
    kwargs = dict(
        auto, output_dir=output_dir, max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], seed=SEED, disable_tqdm=True,
        dataloader_num_workers=0, use_cpu=True,
    )  # fmt: skip
    if "deepspeed" in auto:
        kwargs.update(cpu_deepspeed_training_kwargs())
        allow_bf16_on_cpu_deepspeed()
    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **_):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, 256, (MICRO_BATCH * world_size * STEPS, SEQ_LEN), generator=generator)
    dataset = [{"input_ids": row, "labels": row.clone()} for row in ids]
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=dataset, callbacks=[Losses()])
    trainer.train()
    wrapped = trainer.model_wrapped
    return {
        "plan_pure_bf16": plan.pure_bf16,
        "plan_model_dtype": plan.model_dtype,
        "plan_optimizer_state_dtype": plan.optimizer_state_dtype,
        "bf16_flag": bool(auto.get("bf16")),
        "deepspeed_bf16": (auto.get("deepspeed") or {}).get("bf16"),
        "upcast_warnings": [m for m in handler.messages if "upcast" in m],
        "param_dtypes_after_auto_args": param_dtypes_after_auto_args,
        "wrapped_param_dtypes": dtypes(wrapped.parameters()),
        "model_wrapped": type(wrapped).__name__,
        "distributed_type": str(trainer.accelerator.state.distributed_type).split(".")[-1],
        "accelerate_mixed_precision": trainer.accelerator.mixed_precision,
        "zero_stage": int(wrapped.zero_optimization_stage()) if hasattr(wrapped, "zero_optimization_stage") else None,
        "losses": losses,
        **optimizer_facts(trainer),
    }


def main(argv: list[str] | None = None) -> None:
    """Both modes; the process group stays up (scripts/runs.py runs several scripts in one launch)."""
    from runs import reset_between_runs

    args = parse_args(argv)
    enable_fsdp_on_cpu_from_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    report = {"strategy": args.strategy, "world_size": world_size}
    environ = dict(os.environ)
    for mode, pure in (("default", False), ("pure_bf16", True)):
        report[mode] = run(args.strategy, pure, os.path.join(args.output_dir, mode), world_size)
        reset_between_runs(environ)
    if int(os.environ.get("RANK", "0")) == 0:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
    shutdown()
