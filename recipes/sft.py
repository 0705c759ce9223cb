"""Full-parameter supervised fine-tuning (SFT) of a Llama-class model on chat data.

The loss is computed on assistant tokens only; conversations are rendered with the tokenizer's
chat template (or hf_dist's documented default when it has none). The strategy (DDP, FSDP2,
ZeRO) comes from ``hf_dist.auto_args`` unless you pass ``--strategy``, ``--fsdp``/``--deepspeed``
or an accelerate FSDP/DeepSpeed config. Every ``TrainingArguments`` flag works.

Data: ``--dataset`` is a local .jsonl/.json/.parquet/.csv file (or folder, or ``save_to_disk``
folder) with a ``messages`` column (``[{"role": "user"|"assistant"|"system", "content": ...}]``)
or ``prompt``/``completion`` columns. Without ``--model_name_or_path``/``--dataset`` it trains a
tiny Llama on an embedded string-operation task (``reverse: cadb`` -> ``bdac``) in a few minutes.

Launch (1 CPU, embedded default)::

    accelerate launch --cpu --num_processes 1 recipes/sft.py

One node, 8 GPUs, Llama-3.1-8B. ``hf-dist plan meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80
--seq-len 2048`` prints ``chosen: zero1, offload=none, activation_checkpointing=False`` (46 GiB per
GPU; DDP would need 159 GiB for ~16 bytes/param of model states, and ZeRO-1 shards only the
optimizer, so it communicates the least of the strategies that fit)::

    accelerate launch --num_processes 8 recipes/sft.py \\
        --model_name_or_path meta-llama/Llama-3.1-8B-Instruct --dataset chat.jsonl \\
        --output_dir out/sft-8b --num_train_epochs 1 --learning_rate 2e-5

Two nodes x 8 GPUs, Llama-3.1-70B. ``hf-dist plan meta-llama/Llama-3.1-70B --gpus 16 --nodes 2
--gpu-memory 80`` prints ``chosen: zero3, offload=optimizer, activation_checkpointing=True``
(~1.1 TB of model states do not fit 16 x 80 GB even fully sharded, and FSDP2 cannot offload only
the optimizer). On each node::

    accelerate launch --num_machines 2 --machine_rank $RANK --main_process_ip $MASTER \\
        --main_process_port 29500 --num_processes 16 recipes/sft.py \\
        --model_name_or_path meta-llama/Llama-3.1-70B-Instruct --dataset chat.jsonl --output_dir out/sft-70b

The run ends with eval loss/perplexity, an HF folder in ``<output_dir>/final`` (converted from the
sharded checkpoint with ``hf_dist.convert``), and a generation from that folder reloaded with
``from_pretrained``; ``<output_dir>/results.json`` holds the numbers.
"""

from __future__ import annotations

from hf_dist import recipe_utils as ru

# A tiny Llama on the embedded task: ~2-3 min on 2 CPU processes to high exact-match accuracy.
EMBEDDED_DEFAULTS = dict(ru.EMBEDDED_TRAINING_DEFAULTS, output_dir="outputs/sft")
# Full fine-tuning of a pretrained model: small LR, one epoch, cosine decay.
REAL_DEFAULTS = dict(
    output_dir="outputs/sft",
    num_train_epochs=1,
    learning_rate=2e-5,
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

    model_args, data_args, train_kwargs, explicit = ru.parse_recipe_args(
        (ru.ModelArguments, ru.DataArguments), argv, embedded_defaults=EMBEDDED_DEFAULTS, real_defaults=REAL_DEFAULTS
    )
    # everything that can reject the input runs before the model is built
    tokenizer = ru.load_tokenizer(model_args, chat=True)
    config = ru.load_config(model_args, tokenizer)
    seq_len = ru.resolve_seq_len(data_args.max_seq_length, config, embedded=model_args.embedded)
    ru.check_dataset(data_args, kind="chat")
    # the tiny embedded model is built before the strategy exists (see ru.build_model)
    model = ru.build_model(model_args, config, seed=train_kwargs["seed"]) if model_args.embedded else None
    args = ru.training_arguments(
        train_kwargs, explicit, config, method="full", seq_len=seq_len, strategy=model_args.strategy
    )
    with args.main_process_first(desc="tokenizing"):
        train_ds, eval_ds, task = ru.chat_datasets(data_args, tokenizer, seq_len=seq_len, seed=args.seed)

    if model is None:
        model = ru.build_model(model_args, config, seed=args.seed)
    if args.process_index == 0:
        print(
            ru.describe_plan(config, method="full", seq_len=seq_len, args=args, strategy=model_args.strategy),
            flush=True,
        )
    before = ru.baseline_accuracy(model, tokenizer, task, mode="chat", args=args)

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
    return ru.finish_run(trainer, tokenizer, task=task, mode="chat", adapter=False, before=before)


if __name__ == "__main__":
    main()
    ru.shutdown()  # every rank tears the process group down together, before exiting
