"""Train a tiny Llama with torch FSDP2 on CPU ranks and save a sharded DCP checkpoint like accelerate does.

Usage (2 ranks):  torchrun --nproc_per_node=2 convert_make_fsdp.py OUT [--tied] [--hidden H --layers L]

Writes ``OUT/checkpoint-2/pytorch_model_fsdp_0/`` (``dcp.save({"model": sharded_state_dict})``,
accelerate's layout), ``OUT/checkpoint-2/config.json`` and ``OUT/reference.safetensors``: the
full fp32 state dict gathered by torch's own ``get_model_state_dict(full_state_dict=True)``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=0)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = tiny_llama_config(tie_word_embeddings=args.tied)
    if args.hidden:
        config.hidden_size = args.hidden
        config.intermediate_size = args.intermediate or args.hidden * 4
        config.num_hidden_layers = args.layers
        config.num_attention_heads = config.num_key_value_heads = max(1, args.hidden // 64)
        config.head_dim = 64 if args.hidden >= 64 else args.hidden
        config.vocab_size = args.vocab
    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1 + rank)
    for _ in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ckpt = os.path.join(args.out, f"checkpoint-{args.steps}")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(ckpt, "pytorch_model_fsdp_0"))
    if not args.no_reference:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        config.save_pretrained(ckpt)
        if not args.no_reference:
            from safetensors.torch import save_file

            save_file(
                {k: v.clone().contiguous() for k, v in full.items()}, os.path.join(args.out, "reference.safetensors")
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
