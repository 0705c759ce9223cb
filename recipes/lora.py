"""LoRA fine-tuning (PEFT) of a Llama-class model on chat data; works under DDP, FSDP2 and ZeRO-3.

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

The run ends with eval loss/perplexity, a PEFT adapter folder ``<output_dir>/adapter`` (from the
sharded checkpoint via ``hf_dist.convert(..., adapter=True)`` under FSDP/ZeRO), and a generation
from ``AutoPeftModelForCausalLM.from_pretrained(<output_dir>/adapter)``. With the embedded
default the random base is saved to ``<output_dir>/base`` so the adapter has a base to load on.
"""

from __future__ import annotations

from pathlib import Path

from hf_dist import recipe_utils as ru

EMBEDDED_DEFAULTS = dict(ru.EMBEDDED_TRAINING_DEFAULTS, output_dir="outputs/lora", learning_rate=5e-3)
REAL_DEFAULTS = dict(
    output_dir="outputs/lora",
    num_train_epochs=1,
    learning_rate=2e-4,
    warmup_steps=0.03,
    lr_scheduler_type="cosine",
    logging_steps=10,
    save_strategy="steps",
    save_steps=500,
    save_total_limit=2,
    report_to="none",
)


def main(argv: list[str] | None = None) -> dict:
    from transformers import Trainer

    model_args, data_args, lora_args, train_kwargs, explicit = ru.parse_recipe_args(
        (ru.ModelArguments, ru.DataArguments, ru.LoraArguments),
        argv,
        embedded_defaults=EMBEDDED_DEFAULTS,
        real_defaults=REAL_DEFAULTS,
    )
    tokenizer = ru.load_tokenizer(model_args, chat=True)
    config = ru.load_config(model_args, tokenizer)
    seq_len = ru.resolve_seq_len(data_args.max_seq_length, config, embedded=model_args.embedded)
    ru.check_lora_targets(lora_args, config, trust_remote_code=model_args.trust_remote_code)
    ru.check_dataset(data_args, kind="chat")
    # the tiny embedded model is built before the strategy exists (see ru.build_model)
    model = ru.build_model(model_args, config, seed=train_kwargs["seed"]) if model_args.embedded else None
    args = ru.training_arguments(
        train_kwargs,
        explicit,
        config,
        method="lora",
        seq_len=seq_len,
        strategy=model_args.strategy,
        lora_rank=lora_args.lora_r,
    )
    with args.main_process_first(desc="tokenizing"):
        train_ds, eval_ds, task = ru.chat_datasets(data_args, tokenizer, seq_len=seq_len, seed=args.seed)

    if model is None:
        model = ru.build_model(model_args, config, seed=args.seed)
    else:  # the random base must be on disk for the adapter to be loadable later
        ru.save_base_model(model, tokenizer, Path(args.output_dir) / "base", args)
    if args.process_index == 0:
        print(
            ru.describe_plan(config, method="lora", seq_len=seq_len, args=args, strategy=model_args.strategy),
            flush=True,
        )
    before = ru.baseline_accuracy(model, tokenizer, task, mode="chat", args=args)
    model = ru.apply_lora(model, lora_args)

    resume = ru.resume_checkpoint(args)  # before the Trainer: may edit the DeepSpeed config
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=ru.collator(tokenizer, packed=False),
        processing_class=tokenizer,
        callbacks=[ru.save_at_end_callback()],
    )
    ru.train(trainer, resume)
    return ru.finish_run(trainer, tokenizer, task=task, mode="chat", adapter=True, before=before)


if __name__ == "__main__":
    main()
    ru.shutdown()  # every rank tears the process group down together, before exiting
