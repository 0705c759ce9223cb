"""A user's own training script, as README.md's "Use it in your own script" shows it, on 2 CPU ranks: the model, the
Trainer, ``hf_dist.auto_args(model, strategy=...)`` and ``hf_dist.callbacks.attach(trainer)``, nothing else.

Launched by tests/distributed/test_user_script.py with plain torchrun, without ``ACCELERATE_USE_CPU`` or
``HF_DIST_FSDP_ON_CPU`` (nothing but the script's own calls decides what runs)::

    torchrun --nproc_per_node 2 tests/distributed/scripts/user_script_train.py --strategy zero3 \
        --output-dir out --out report.json

First the README's call as written, ``auto_args(model, strategy=S)``: accelerate would drop FSDP on CPU ranks (plain
DDP trains) and set DeepSpeed up for one rank, so it must be refused, naming the call that runs ``S``. Then that call,
``auto_args(model, strategy=S, engine_on_cpu=True)``, trains two steps under ``attach(trainer)`` (no ``plan=``).
Rank 0 reports the refusal, the plan ``attach`` found, what wrapped the model, what stepped and the checkpoint files.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SEQ_LEN = 16
STEPS = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", required=True, help="fsdp_full_shard or zero3")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--out", required=True, help="JSON report written by rank 0")
    return parser.parse_args()


def refusal(model, strategy: str) -> str | None:
    """The README's call as written on these CPU ranks: its refusal's text, or None if it returned kwargs."""
    import hf_dist

    try:
        hf_dist.auto_args(model, strategy=strategy, seq_len=SEQ_LEN, global_batch_size=4)
    except ValueError as exc:
        return str(exc)
    return None


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_dist
    from hf_dist.callbacks.plan import PlanCallback, running_optimizer
    from hf_dist.testing import TokenDataset, tiny_llama_config

    args = parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32)
    refused = refusal(model, args.strategy)
    kwargs = hf_dist.auto_args(model, strategy=args.strategy, seq_len=SEQ_LEN, global_batch_size=4, engine_on_cpu=True)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=STEPS, save_steps=STEPS, logging_steps=1, report_to=[], **kwargs
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(16, seq=SEQ_LEN))
    check = [cb for cb in hf_dist.callbacks.attach(trainer) if isinstance(cb, PlanCallback)]
    trainer.train()
    wrapped = trainer.model_wrapped
    report = {
        "refusal": refused,
        "plan_checked": bool(check),
        "plan_strategy": check[0].plan.strategy if check else None,
        "mismatches": check[0].mismatches if check else None,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        "model_wrapped": type(wrapped).__name__,
        "model": type(trainer.model).__name__,
        "zero_stage": int(wrapped.zero_optimization_stage()) if hasattr(wrapped, "zero_optimization_stage") else None,
        "optimizer": running_optimizer(trainer.optimizer),
        "global_step": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        root = Path(args.output_dir)
        report["checkpoint_files"] = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, args.out)
    trainer.accelerator.end_training()  # last line, every rank (README)


if __name__ == "__main__":
    main()
