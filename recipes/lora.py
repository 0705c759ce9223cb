"""LoRA fine-tuning (PEFT) of a Llama-class model on chat data; works under DDP, FSDP2 and ZeRO-3.

This file is ``recipes/sft.py`` with ``method="lora"``: the same flow, read there top to bottom.

The base weights are frozen; rank-``--lora_r`` adapters are trained on every linear layer of a
Llama block (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``) unless
``--lora_target_modules`` names others (an unknown name fails before loading, listing the
model's linear layers). Loss on assistant tokens only, chat template applied, as in
``recipes/sft.py``. The strategy comes from ``hf_dist.auto_args`` (``--strategy`` pins it).

Launch (1 CPU, embedded default)::

    accelerate launch --cpu --num_processes 1 recipes/lora.py

One node, 8 GPUs, Llama-3.1-8B. ``hf-dist plan meta-llama/Llama-3.1-8B --method lora --gpus 8
--gpu-memory 80`` prints ``chosen: ddp, offload=none, activation_checkpointing=False`` (34 GiB
per GPU: ~16 GB of bf16 weights plus adapters and their optimizer state; DDP communicates least)::

    accelerate launch --num_processes 8 recipes/lora.py \\
        --model_name_or_path meta-llama/Llama-3.1-8B-Instruct --dataset chat.jsonl \\
        --output_dir out/lora-8b --learning_rate 2e-4

Two nodes x 8 GPUs, Llama-3.1-70B. ``hf-dist plan meta-llama/Llama-3.1-70B --method lora --gpus 16
--nodes 2 --gpu-memory 80`` prints ``chosen: hsdp, offload=none, activation_checkpointing=True``
(140 GB of bf16 weights do not fit one GPU; HSDP shards them inside a node and replicates across the
two, keeping the slow inter-node link to the small gradient all-reduce). On each node::

    accelerate launch --num_machines 2 --machine_rank $RANK --main_process_ip $MASTER \\
        --main_process_port 29500 --num_processes 16 recipes/lora.py \\
        --model_name_or_path meta-llama/Llama-3.1-70B-Instruct --dataset chat.jsonl --output_dir out/lora-70b

The run ends with eval loss/perplexity and a PEFT adapter folder ``<output_dir>/adapter`` (from the
sharded checkpoint via ``hf_dist.convert(..., adapter=True)`` under FSDP/ZeRO); on the embedded task, or
with ``--check_export``, a generation from ``AutoPeftModelForCausalLM.from_pretrained(<output_dir>/adapter)``. With the embedded
default the random base is saved to ``<output_dir>/base`` so the adapter has a base to load on.
"""

from __future__ import annotations

import functools
from pathlib import Path

from hf_dist import recipe_utils as ru

sft = ru.load_recipe(Path(__file__).with_name("sft.py"))
main = functools.partial(sft.main, method="lora")


if __name__ == "__main__":
    ru.run_recipe(main)  # a refusal: printed once by rank 0, exit 2 on every rank; then the process group torn down
