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

Under FSDP2 the same ranks then run what a user's own script gets wrong (issue 39), each refused by ``attach`` alone:
a LoRA created while the ranks' RNG states differ (as after rank-dependent work, without a seed before
``get_peft_model``) under FSDP2 without ``cpu_ram_efficient_loading`` is refused; the control, that check switched
off, shows FSDP2 really trains a mix of the ranks' adapters; with auto_args' ``cpu_ram_efficient_loading`` (rank 0's
weights broadcast) it trains rank 0's adapter and is let through; the same LoRA seeded trains. Last, resuming ``checkpoint-2`` into a model of another width is refused.
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


def lora_run(output_dir: Path, *, seeded: bool, broadcast: bool = False, checked: bool = True) -> dict:
    """A LoRA on the tiny model under FSDP2 and ``attach``: its refusal, or (trained) whether the adapter FSDP2 sharded
    is rank 0's (``kept``, read at train begin) and the losses. ``broadcast``: auto_args' ``cpu_ram_efficient_loading``
    (accelerate sends rank 0's weights to every rank); without it, as ``TrainingArguments(fsdp=...)``'s default, each
    rank keeps its slice of its own copy."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from runs import reset_between_runs
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import hf_dist
    import hf_dist.runtime.replicas as replicas
    from hf_dist.runtime.dist import broadcast_object
    from hf_dist.testing import TokenDataset, tiny_llama_config

    reset_between_runs()
    torch.manual_seed(0)  # the base model agrees on every rank
    base = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32)
    if seeded:
        transformers.set_seed(0)
    else:
        torch.manual_seed(100 + int(os.environ["RANK"]))  # the RNG state differs by rank
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    name, first = next((n, p.detach().clone()) for n, p in model.named_parameters() if "lora_A" in n)
    rank0_first = broadcast_object(first)
    kwargs = hf_dist.auto_args(model, strategy="fsdp_full_shard", seq_len=SEQ_LEN, global_batch_size=4,
                               engine_on_cpu=True)  # fmt: skip
    kwargs["fsdp_config"] = {**kwargs["fsdp_config"], "cpu_ram_efficient_loading": broadcast}
    training_args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, save_strategy="no",
                                      logging_steps=1, report_to=[], **kwargs)  # fmt: skip
    kept = []

    class Kept(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            kept.append(bool(torch.equal(dict(model.named_parameters())[name].full_tensor(), rank0_first)))

    trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(16, seq=SEQ_LEN),
                      callbacks=[Kept()])  # fmt: skip
    check = replicas.check_replicas_agree
    try:
        if not checked:
            replicas.check_replicas_agree = lambda model: None
        hf_dist.callbacks.attach(trainer)
    except replicas.ReplicaMismatchError as exc:
        return {"refusal": str(exc)}
    finally:
        replicas.check_replicas_agree = check
    trainer.train()
    return {
        "refusal": None,
        "kept": kept[0],
        "global_step": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


def other_model_resume(output_dir: Path) -> str | None:
    """``trainer.train(resume_from_checkpoint=True)`` of ``output_dir`` (the tiny model's checkpoint-2) with a model
    twice as wide, under FSDP2 and ``attach``: the refusal, or None when it resumed."""
    import torch
    from runs import reset_between_runs
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_dist
    from hf_dist.checkpoint.lifecycle.model_config import OtherModelError
    from hf_dist.testing import TokenDataset, tiny_llama_config

    reset_between_runs()
    config = tiny_llama_config()
    config.hidden_size *= 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = hf_dist.auto_args(model, strategy="fsdp_full_shard", seq_len=SEQ_LEN, global_batch_size=4,
                               engine_on_cpu=True)  # fmt: skip
    training_args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS + 1, save_strategy="no",
                                      report_to=[], **kwargs)  # fmt: skip
    trainer = Trainer(model=model, args=training_args, train_dataset=TokenDataset(16, seq=SEQ_LEN))
    hf_dist.callbacks.attach(trainer)
    try:
        trainer.train(resume_from_checkpoint=True)
    except OtherModelError as exc:
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
    if args.strategy == "fsdp_full_shard":
        runs = Path(args.output_dir).parent
        report["lora_unseeded"] = lora_run(runs / "lora-unseeded", seeded=False)
        report["lora_unseeded_unchecked"] = lora_run(runs / "lora-unchecked", seeded=False, checked=False)
        report["lora_unseeded_broadcast"] = lora_run(runs / "lora-broadcast", seeded=False, broadcast=True)
        report["lora_seeded"] = lora_run(runs / "lora-seeded", seeded=True)
        report["other_model_resume"] = other_model_resume(Path(args.output_dir))
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
