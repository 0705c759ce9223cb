"""Train a tiny Llama with the HF Trainer on CPU ranks (ZeRO-1/2/3 or FSDP2) and save a checkpoint-N folder.

Usage (2 ranks):
    torchrun --nproc_per_node=2 convert_trainer.py OUT --mode zero3 [--bf16]
    HF_DIST_FSDP_ON_CPU=1 torchrun --nproc_per_node=2 convert_trainer.py OUT --mode fsdp2

Writes ``OUT/checkpoint-STEPS/`` (the Trainer's own save), ``OUT/reference.safetensors`` (the
trained weights gathered by the engine itself: ZeRO-3 16-bit consolidation, the ZeRO-1/2 module,
or torch's full-state-dict gather for FSDP2), ``OUT/model-config/config.json`` and
``OUT/facts.json`` (what really ran).
The DeepSpeed config is written inline here on purpose: this test checks the converter, not a factory.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs, enable_fsdp_on_cpu_from_env
from hf_dist.runtime.dist import shutdown


def deepspeed_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": "auto"},
        "steps_per_print": 1000,
    }


def reference_state(trainer, mode: str) -> dict:
    if mode == "zero3":
        return trainer.model_wrapped._zero3_consolidated_16bit_state_dict()
    if mode.startswith("zero"):
        return {k: v.detach().clone() for k, v in trainer.model_wrapped.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(argv: list[str] | None = None) -> None:
    """One Trainer run; the process group stays up (scripts/runs.py runs several in one launch)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", choices=("zero1", "zero2", "zero3", "fsdp2"), required=True)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    enable_fsdp_on_cpu_from_env()

    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_dist.testing import tiny_llama_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    kwargs = dict(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=2, learning_rate=1e-2,
        save_strategy="steps", save_steps=args.steps, report_to=[], disable_tqdm=True, use_cpu=True,
        dataloader_num_workers=0, logging_steps=1,
    )  # fmt: skip
    if args.mode.startswith("zero"):
        kwargs["deepspeed"] = deepspeed_config(int(args.mode[-1]))
        kwargs.update(cpu_deepspeed_training_kwargs())
    else:
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT",
            "reshard_after_forward": True,
        }
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2 * 2 * args.steps, 16), generator=generator)
    dataset = [{"input_ids": row, "labels": row.clone()} for row in ids]
    training_args = TrainingArguments(**kwargs)
    if args.bf16:
        # TrainingArguments refuses bf16 without a GPU, but DeepSpeed trains bf16 on CPU: switch it on
        # after validation, in the arguments and in the DeepSpeed config they already resolved.
        training_args.bf16 = True
        training_args.hf_deepspeed_config.config["bf16"]["enabled"] = True
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()
    reference = reference_state(trainer, args.mode)
    if trainer.is_world_process_zero():
        from safetensors.torch import save_file

        model.config.save_pretrained(os.path.join(args.out, "model-config"))  # FSDP saves none in checkpoint-N
        save_file({k: v.detach().clone().contiguous() for k, v in reference.items()},
                  os.path.join(args.out, "reference.safetensors"))  # fmt: skip
        facts = {
            "distributed_type": str(trainer.accelerator.state.distributed_type).split(".")[-1],
            "model_class": type(trainer.model).__name__,
            "mode": args.mode,
            "deepspeed": trainer.is_deepspeed_enabled,
            "zero_stage": trainer.model_wrapped.zero_optimization_stage() if trainer.is_deepspeed_enabled else None,
            "bf16": bool(trainer.model_wrapped.bfloat16_enabled()) if trainer.is_deepspeed_enabled else None,
        }
        with open(os.path.join(args.out, "facts.json"), "w") as handle:
            json.dump(facts, handle)


if __name__ == "__main__":
    main()
    shutdown()
