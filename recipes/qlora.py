"""QLoRA: LoRA adapters on a 4-bit (NF4, bitsandbytes) frozen base model. Needs a CUDA GPU.

This file is ``recipes/sft.py`` with ``method="qlora"``: the same flow, read there top to bottom.

On a machine without a GPU it stops with a clear error before any tokenizer, data or model is
loaded (bitsandbytes has no CPU training kernels); use ``recipes/lora.py`` there. Otherwise it
is ``recipes/lora.py`` with the base loaded through ``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16,
bnb_4bit_quant_storage=bfloat16)`` (the storage dtype lets FSDP shard the quantized weights).

One GPU, Llama-3.1-8B. ``hf-dist plan meta-llama/Llama-3.1-8B --method qlora --gpus 1 --gpu-memory 24``
prints ``chosen: ddp, offload=none, activation_checkpointing=True`` (11 GiB: ~5 GB of 4-bit weights,
adapters, and checkpointed activations; the 128k-vocab logits need checkpointing to fit 24 GB)::

    accelerate launch --num_processes 1 recipes/qlora.py \\
        --model_name_or_path meta-llama/Llama-3.1-8B-Instruct --dataset chat.jsonl --output_dir out/qlora-8b

One node, 8 GPUs, Llama-3.1-8B (``hf-dist plan ... --method qlora --gpus 8 --gpu-memory 80`` prints
``chosen: ddp, offload=none, activation_checkpointing=False``)::

    accelerate launch --num_processes 8 recipes/qlora.py \\
        --model_name_or_path meta-llama/Llama-3.1-8B-Instruct --dataset chat.jsonl --output_dir out/qlora-8b

Two nodes x 8 GPUs, Llama-3.1-70B (``hf-dist plan meta-llama/Llama-3.1-70B --method qlora --gpus 16
--nodes 2 --gpu-memory 80`` prints ``chosen: ddp, offload=none, activation_checkpointing=True``: ~35 GB
of 4-bit weights fit one 80 GB GPU; ``--strategy fsdp_full_shard`` shards them on smaller cards).
On each node::

    accelerate launch --num_machines 2 --machine_rank $RANK --main_process_ip $MASTER \\
        --main_process_port 29500 --num_processes 16 recipes/qlora.py \\
        --model_name_or_path meta-llama/Llama-3.1-70B-Instruct --dataset chat.jsonl --output_dir out/qlora-70b

Without ``--model_name_or_path`` the embedded tiny Llama is saved to ``<output_dir>/base`` and
reloaded in 4 bits (a GPU smoke test). Ends with eval loss, ``<output_dir>/adapter`` and a sample.
"""

from __future__ import annotations

import functools
from pathlib import Path

from hf_dist import recipe_utils as ru

sft = ru.load_recipe(Path(__file__).with_name("sft.py"))
main = functools.partial(sft.main, method="qlora")


if __name__ == "__main__":
    ru.run_recipe(main)  # a refusal: printed once by rank 0, exit 2 on every rank; then the process group torn down
