"""TRL's SFTTrainer on CPU ranks with ``SFTConfig(**hf_dist.auto_args(model, plan=plan, config_class=SFTConfig))`` and
``attach(trainer, plan=plan)``: the plan's contract is checked at train start (it refuses on any difference), and
this script records what really ran.

    torchrun --nproc_per_node 2 trl_sft_train.py --strategy ddp --out report.json --output-dir run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

SEQ_LEN = 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    import hf_dist
    from hf_dist.callbacks import attach
    from hf_dist.data.tokenizer import build_tokenizer
    from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu_from_env
    from hf_dist.runtime.dist import live_strategy, shutdown
    from hf_dist.testing import tiny_llama_config

    enable_fsdp_on_cpu_from_env()
    tokenizer = build_tokenizer(model_max_length=SEQ_LEN)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=len(tokenizer)))
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    plan = hf_dist.plan(
        model, gpus=world, strategy=args.strategy, seq_len=SEQ_LEN, global_batch_size=4, fused_lm_head=True
    )
    kwargs = hf_dist.auto_args(model, plan=plan, config_class=SFTConfig, max_length=SEQ_LEN)
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=3, logging_steps=1, save_strategy="no", report_to=[],
        learning_rate=1e-3, dataset_text_field="text", disable_tqdm=True, **kwargs,
    )  # fmt: skip
    data = Dataset.from_dict({"text": [f"{i} plus {i} is {2 * i}." for i in range(64)]})
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)
    callbacks = attach(trainer, plan=plan)  # PlanCallback(strict=True): refuses to train on any difference
    trainer.train()
    if trainer.args.process_index == 0:
        report = {
            "world_size": trainer.args.world_size,
            "strategy": live_strategy(trainer.args),
            "wrapped": type(trainer.model_wrapped).__name__,
            "model_type": type(trainer.model).__name__,
            "checkpointing": trainer.args.activation_checkpointing
            if hasattr(trainer.args, "activation_checkpointing")
            else trainer.args.gradient_checkpointing,
            "bf16": trainer.args.bf16,
            "batch": [config.per_device_train_batch_size, config.gradient_accumulation_steps],
            "planned": [plan.strategy, plan.world_size, plan.micro_batch_size, plan.gradient_accumulation_steps],
            "mismatches": callbacks[0].mismatches,
            "steps": trainer.state.global_step,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        }
        Path(args.out).write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
