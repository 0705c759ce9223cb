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

Ends with eval loss/perplexity and an HF folder in ``<output_dir>/final``; on the embedded task, or with
``--check_export``, the folder is reloaded with ``from_pretrained`` and sampled.
"""

from __future__ import annotations

from hf_dist import recipe_utils as ru

EMBEDDED_DEFAULTS = dict(ru.EMBEDDED_TRAINING_DEFAULTS, output_dir="outputs/pretrain")
REAL_DEFAULTS = dict(ru.REAL_TRAINING_DEFAULTS, output_dir="outputs/pretrain", learning_rate=1e-5, warmup_steps=0.01,
                     save_steps=1000)  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    # every check of the arguments, before any model is built: a refusal is printed once, no traceback (ru.run_recipe)
    with ru.checking():
        model_args, data_args, run_args, train_kwargs, explicit = ru.parse_recipe_args(
            (ru.ModelArguments, ru.DataArguments, ru.RunArguments),
            argv,
            embedded_defaults=EMBEDDED_DEFAULTS,
            real_defaults=REAL_DEFAULTS,
        )
        ru.cpu_test_modes(run_args)  # --fsdp_on_cpu / --model_parallel_on_cpu: tests and CPU development only
        ru.check_output_dir(train_kwargs["output_dir"], resuming=bool(train_kwargs.get("resume_from_checkpoint")))
        ru.check_model_source(model_args)  # a hub name with no hub: refused in a second, not after retries
        tokenizer = ru.load_tokenizer(model_args, chat=False)
        config = ru.model_config(model_args, tokenizer)
        seq_len = ru.resolve_seq_len(data_args.max_seq_length, config, embedded=model_args.embedded)
        ru.check_dataset(data_args, kind="text")
        request = model_args.plan_request("full", seq_len, async_save=run_args.async_save)
        args = ru.training_arguments(train_kwargs, explicit, config, request, nvme_path=model_args.nvme_path,
                                     deepspeed_on_cpu=run_args.deepspeed_on_cpu)  # fmt: skip
        if data_args.document_attention:  # refused where the layout or attention cannot keep documents apart
            ru.packing_attention(model_args.attn_implementation, args)
        resume = ru.resume_checkpoint(args)  # --resume_from_checkpoint: checked against this run, said in one line
    if ru.is_finished(resume, args):  # the checkpoint is at the last step: nothing to train, nothing to redo
        return ru.earlier_results(args)

    load = ru.parallel_load_kwargs(args)  # the TP plan under tensor parallelism: sharded as it loads
    # the tiny embedded model is built whole, outside DeepSpeed's zero.Init (see ru.build_model)
    model = ru.build_model(model_args, config, seed=args.seed) if model_args.embedded else None
    with args.main_process_first(desc="packing"):
        train_ds, eval_ds, task = ru.text_datasets(data_args, tokenizer, seq_len=seq_len, seed=args.seed)

    if model is not None and ru.shards_at_load(load):  # a TP model is sharded as it loads: from disk
        model = ru.embedded_base_on_disk(model, tokenizer, model_args, args, reload=True)
    if model is None:
        model = ru.build_model(model_args, config, seed=args.seed, **load)
    ru.print_plan(config, method="full", seq_len=seq_len, args=args, strategy=model_args.strategy,
                  trust_remote_code=model_args.trust_remote_code)  # fmt: skip
    before = ru.baseline_accuracy(model, tokenizer, task, mode="text", args=args)

    rows = "packed" if data_args.document_attention else "blocks"  # per-document attention, or the whole block
    trainer = ru.make_trainer(model, args, tokenizer, train_ds, eval_ds, rows=rows, seq_len=seq_len)
    ru.train(trainer, resume, async_save=run_args.async_save)
    return ru.finish_run(trainer, tokenizer, task=task, mode="text", adapter=False, before=before,
                         check_export=run_args.check_export,
                         trust_remote_code=model_args.trust_remote_code)  # fmt: skip


if __name__ == "__main__":
    ru.run_recipe(main)  # a refusal: printed once by rank 0, exit 2 on every rank; then the process group torn down
