"""Train a tiny Llama with the Trainer (FSDP2 or ZeRO) and write per-step losses; resume optionally.

Launched by tests/distributed/test_reshard.py at 1, 2 and 3 CPU ranks. The global batch (6) is the
same at every world size, so a resumed run sees the same samples per step as an uninterrupted one.

    torchrun --nproc_per_node 2 reshard_train.py --backend fsdp --out OUT --max-steps 6 --save-steps 3
    torchrun --nproc_per_node 3 reshard_train.py --backend fsdp --out OUT --max-steps 6 --resume OUT/checkpoint-3
    torchrun --nproc_per_node 3 reshard_train.py --backend zero2 --out OUT2 --max-steps 6 --auto-resume

Several runs share a launch through scripts/runs.py (the test launches each engine's runs at one world size once).
``--resume`` goes through ``hf_dist.checkpoint.lifecycle.reshard.prepare_resume``; ``--auto-resume`` through
``hf_dist.auto_resume(OUT, training_args=...)``, which finds the newest complete checkpoint in OUT itself.
"""

from __future__ import annotations

import argparse
import json
import os

GLOBAL_BATCH = 6
SEQ_LEN = 16


def strategy_args(backend: str, model) -> dict:
    """TrainingArguments kwargs from the shared factories (hf_dist.configs), fp32 on CPU."""
    from hf_dist.bench import strategy_kwargs

    strategy = "fsdp_full_shard" if backend == "fsdp" else backend
    return strategy_kwargs(strategy, model, precision="no", device="cpu")


def adam_step(optimizer) -> int:
    """Adam's step counter after training: proves the optimizer state was restored, not restarted."""
    import torch

    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer  # accelerate / DeepSpeed wrappers hold the torch optimizer
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    return max(steps, default=0)


def main(argv: list[str] | None = None) -> None:
    """One Trainer run; the process group stays up (scripts/runs.py runs several in one launch)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["fsdp", "zero1", "zero2", "zero3"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("--resume", default=None)
    resume.add_argument("--auto-resume", action="store_true")
    parser.add_argument("--loss-file", required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_dist.testing import tiny_llama_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if GLOBAL_BATCH % world:
        raise ValueError(f"world size {world} must divide the global batch {GLOBAL_BATCH}")
    if args.backend == "fsdp":
        from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu

        enable_fsdp_on_cpu()  # accelerate would otherwise silently train plain DDP on CPU
        cpu_kwargs = {"use_cpu": True}
    else:
        from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs

        # accelerate drops DeepSpeed when cpu=True and would otherwise count 1 process on CPU
        cpu_kwargs = {"use_cpu": False, **cpu_deepspeed_training_kwargs()}

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (GLOBAL_BATCH * args.max_steps, SEQ_LEN), generator=gen)
    dataset = [{"input_ids": row, "labels": row} for row in data]

    losses: dict[int, float] = {}
    optimizer_steps: list[int] = []

    class Record(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses[state.global_step] = float(logs["loss"])

        def on_train_end(self, a, state, control, optimizer=None, **kw):
            optimizer_steps.append(adam_step(optimizer))

    training_args = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        save_strategy="steps",
        logging_steps=1,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        report_to=[],
        **cpu_kwargs,
        dataloader_num_workers=0,
        seed=0,
        save_only_model=False,
        **strategy_args(args.backend, model),
    )
    if args.resume:
        from hf_dist.checkpoint.lifecycle.reshard import prepare_resume

        # converts a ZeRO checkpoint saved at another world size to universal and enables load_universal
        args.resume = prepare_resume(args.resume, world, training_args=training_args)
    elif args.auto_resume:
        from hf_dist import auto_resume

        args.resume = auto_resume(args.out, training_args=training_args)
        if args.resume is None:
            raise SystemExit(f"--auto-resume: no complete checkpoint in {args.out}")
    from hf_dist.callbacks import CompleteCheckpointCallback, attach
    from hf_dist.checkpoint.lifecycle.reshard import reshard_callback

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    attach(trainer, [Record(), CompleteCheckpointCallback(), reshard_callback()])  # the resume's loads guarded
    trainer.train(resume_from_checkpoint=args.resume)
    if trainer.is_world_process_zero():
        wrapped = type(trainer.model_wrapped).__name__
        info = {
            "losses": losses,
            "adam_step": optimizer_steps[0],
            "world_size": world,
            "model_type": type(trainer.model).__name__,
            "wrapped": wrapped,
            "zero_stage": trainer.model_wrapped.zero_optimization_stage() if trainer.is_deepspeed_enabled else None,
        }
        with open(args.loss_file, "w") as f:
            json.dump(info, f)


if __name__ == "__main__":
    from hf_dist.runtime.dist import shutdown

    main()
    shutdown()
