"""Train a tiny Llama for a few steps with DeepSpeed directly on CPU ranks and save a checkpoint.

Usage (2 ranks):  torchrun --nproc_per_node=2 convert_make_deepspeed.py OUT z3:3:bf16:tied z2:2:fp32 ...

Writes, per variant, ``OUT/NAME/ds/`` (engine.save_checkpoint, with ``latest``), ``OUT/NAME/ds/config.json`` and
``OUT/NAME/reference.safetensors``: the trained weights consolidated by the engine itself (16-bit
consolidation for ZeRO-3, the module's full params for ZeRO-1/2), which the converter must match.

fp16 variants run on any CPU: where oneDNN has no fp16 (DeepSpeed's CPU accelerator then refuses fp16),
DeepSpeed's own fp16 path runs on torch's portable CPU kernels and ``OUT/NAME/facts.json`` says so.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from hf_dist.runtime.dist import shutdown


def ds_config(stage: int, dtype: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def build_model(args):
    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(tie_word_embeddings=args.tied)
    if args.hidden:
        config.hidden_size = args.hidden
        config.intermediate_size = args.hidden * 4 if args.intermediate is None else args.intermediate
        config.num_hidden_layers = args.layers
        config.num_attention_heads = max(1, args.hidden // 64)
        config.num_key_value_heads = config.num_attention_heads
        config.head_dim = config.hidden_size // config.num_attention_heads
        config.vocab_size = args.vocab
    model = AutoModelForCausalLM.from_config(config)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def parse_variant(text: str) -> argparse.Namespace:
    """``NAME:STAGE:DTYPE[:tied][:lora]`` -> the settings of one training run."""
    name, stage, dtype, *flags = text.split(":")
    return argparse.Namespace(name=name, stage=int(stage), dtype=dtype, tied="tied" in flags, lora="lora" in flags)


def train_and_save(args, variant, out: str) -> None:
    import deepspeed

    from hf_dist.testing import allow_portable_fp16_in_deepspeed

    fp16_kernels = None
    if variant.dtype == "fp16":
        fp16_kernels = "portable" if allow_portable_fp16_in_deepspeed() else "native"

    settings = argparse.Namespace(**{**vars(args), **vars(variant)})
    model = build_model(settings)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(variant.stage, variant.dtype))
    base = model.base_model.model if variant.lora else model
    generator = torch.Generator().manual_seed(1 + engine.global_rank)
    for _ in range(args.steps):
        ids = torch.randint(0, base.config.vocab_size, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    ckpt = os.path.join(out, "ds")
    engine.save_checkpoint(ckpt)
    reference = None
    if args.no_reference:
        pass
    elif variant.stage == 3:
        reference = engine._zero3_consolidated_16bit_state_dict()
    else:
        reference = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    if engine.global_rank == 0:
        with open(os.path.join(out, "facts.json"), "w") as f:
            json.dump({"dtype": variant.dtype, "fp16_kernels": fp16_kernels}, f)
        base.config.save_pretrained(ckpt)
        if variant.lora:
            model.peft_config["default"].save_pretrained(ckpt)
        if reference is not None:
            from safetensors.torch import save_file

            tensors = {k: v.detach().clone().contiguous() for k, v in reference.items()}
            save_file(tensors, os.path.join(out, "reference.safetensors"))
    torch.distributed.barrier()
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("variants", nargs="+", type=parse_variant, help="NAME:STAGE:DTYPE[:tied][:lora]")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=0, help="benchmark sizes: hidden size (0 = tiny)")
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for variant in args.variants:
        train_and_save(args, variant, os.path.join(args.out, variant.name))
    shutdown()


if __name__ == "__main__":
    main()
