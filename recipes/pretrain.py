"""Continued pretraining of a Llama-class model on raw text, with sequence packing.

Documents are tokenized, joined with eos and cut into ``--max_seq_length`` blocks, so every token
in a batch is a real token (no padding) and the loss is on every token. ``--dataset`` needs a
``text`` column (.jsonl/.json/.parquet/.csv file, folder, or ``save_to_disk`` folder). The
strategy comes from ``hf_dist.auto_args`` unless ``--strategy``/``--fsdp``/``--deepspeed`` or an
accelerate config chooses it. Without arguments it trains a tiny Llama on the embedded task as
plain text lines (``reverse: cadb = bdac``).

Launch (1 CPU, embedded default)::

    accelerate launch --cpu --num_processes 1 recipes/pretrain.py

One node, 8 GPUs, Llama-3.1-8B (``hf-dist plan meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80
--seq-len 4096`` prints ``chosen: zero1, offload=none, activation_checkpointing=False``: ~128 GB of
model states do not fit one GPU under DDP; sharding the optimizer is enough)::

    accelerate launch --num_processes 8 recipes/pretrain.py \\
        --model_name_or_path meta-llama/Llama-3.1-8B --dataset corpus/ --max_seq_length 4096 \\
        --output_dir out/cpt-8b --learning_rate 1e-5 --num_train_epochs 1

Two nodes x 8 GPUs, Llama-3.1-70B (``hf-dist plan meta-llama/Llama-3.1-70B --gpus 16 --nodes 2
--gpu-memory 80 --seq-len 4096`` prints ``chosen: zero3, offload=optimizer,
activation_checkpointing=True``). On each node::

    accelerate launch --num_machines 2 --machine_rank $RANK --main_process_ip $MASTER \\
        --main_process_port 29500 --num_processes 16 recipes/pretrain.py \\
        --model_name_or_path meta-llama/Llama-3.1-70B --dataset corpus/ --output_dir out/cpt-70b

Ends with eval loss/perplexity, an HF folder in ``<output_dir>/final`` and a generation from it.
"""

from __future__ import annotations

from hf_dist import recipe_utils as ru

EMBEDDED_DEFAULTS = dict(ru.EMBEDDED_TRAINING_DEFAULTS, output_dir="outputs/pretrain")
REAL_DEFAULTS = dict(
    output_dir="outputs/pretrain",
    num_train_epochs=1,
    learning_rate=1e-5,
    warmup_steps=0.01,
    lr_scheduler_type="cosine",
    logging_steps=10,
    save_strategy="steps",
    save_steps=1000,
    save_total_limit=2,
    report_to="none",
)


def main(argv: list[str] | None = None) -> dict:
    from transformers import Trainer

    model_args, data_args, train_kwargs, explicit = ru.parse_recipe_args(
        (ru.ModelArguments, ru.DataArguments), argv, embedded_defaults=EMBEDDED_DEFAULTS, real_defaults=REAL_DEFAULTS
    )
    tokenizer = ru.load_tokenizer(model_args, chat=False)
    config = ru.load_config(model_args, tokenizer)
    seq_len = ru.resolve_seq_len(data_args.max_seq_length, config, embedded=model_args.embedded)
    ru.check_dataset(data_args, kind="text")
    # the tiny embedded model is built before the strategy exists (see ru.build_model)
    model = ru.build_model(model_args, config, seed=train_kwargs["seed"]) if model_args.embedded else None
    args = ru.training_arguments(
        train_kwargs, explicit, config, method="full", seq_len=seq_len, strategy=model_args.strategy
    )
    with args.main_process_first(desc="packing"):
        train_ds, eval_ds, task = ru.text_datasets(data_args, tokenizer, seq_len=seq_len, seed=args.seed)

    if model is None:
        model = ru.build_model(model_args, config, seed=args.seed)
    if args.process_index == 0:
        print(ru.describe_plan(config, method="full", seq_len=seq_len, args=args, strategy=model_args.strategy))
    before = ru.baseline_accuracy(model, tokenizer, task, mode="text", args=args)

    resume = ru.resume_checkpoint(args)  # before the Trainer: may edit the DeepSpeed config
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=ru.collator(tokenizer, packed=True),
        processing_class=tokenizer,
        callbacks=[ru.save_at_end_callback()],
    )
    ru.train(trainer, resume)
    return ru.finish_run(trainer, tokenizer, task=task, mode="text", adapter=False, before=before)


if __name__ == "__main__":
    main()
    ru.shutdown()  # every rank tears the process group down together, before exiting
