"""Full-parameter supervised fine-tuning (SFT) of a Llama-class model on chat data.

The loss is computed on assistant tokens only; conversations are rendered with the tokenizer's
chat template (or hf_dist's documented default when it has none). The strategy (DDP, FSDP2,
ZeRO) comes from ``hf_dist.auto_args`` unless you pass ``--strategy``, ``--fsdp``/``--deepspeed``
or an accelerate FSDP/DeepSpeed config; ``--tp_size``/``--cp_size``/``--sp_size`` pin tensor, context and
sequence parallelism (the plan chooses them otherwise; a TP model is loaded with ``tp_plan="auto"``). Every
``TrainingArguments`` flag works.

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

The run ends with eval loss/perplexity and an HF folder in ``<output_dir>/final`` (converted from the
sharded checkpoint with ``hf_dist.convert``); ``<output_dir>/results.json`` holds the numbers. On the
embedded task, or with ``--check_export``, that folder is reloaded with ``from_pretrained`` and sampled.

This file is also LoRA and QLoRA: ``recipes/lora.py`` and ``recipes/qlora.py`` are
:func:`main` with ``method="lora"``/``"qlora"`` (the adapter, its defaults and the 4-bit base are
the only differences, each an ``if`` below).
"""

from __future__ import annotations

from hf_dist import recipe_utils as ru

# A tiny Llama on the embedded task: ~2-3 min on 2 CPU processes to high exact-match accuracy.
# Adapters on a frozen *random* base learn slowly and diverge at high LRs. Measured with recipes/lora.py (1 CPU
# process = qlora's global batch 16 on one GPU): 300 steps @ 5e-3: exact match 0 % -> 0 % (loss 4.01 -> 3.56,
# as on an H100 with QLoRA); @ 2e-2 and @ 1e-2: loss stuck near 4; 1200 steps @ 2e-3: 86 %; @ 1e-3: 98 %.
EMBEDDED_DEFAULTS = {
    "full": dict(ru.EMBEDDED_TRAINING_DEFAULTS, output_dir="outputs/sft"),
    "lora": dict(ru.EMBEDDED_TRAINING_DEFAULTS, output_dir="outputs/lora", learning_rate=5e-3),
    "qlora": dict(ru.EMBEDDED_TRAINING_DEFAULTS, output_dir="outputs/qlora", max_steps=1200, learning_rate=1e-3),
}
# Fine-tuning a pretrained model: one epoch, cosine decay; a small LR for all weights, a larger one for adapters.
REAL_DEFAULTS = {
    "full": dict(ru.REAL_TRAINING_DEFAULTS, output_dir="outputs/sft", learning_rate=2e-5),
    "lora": dict(ru.REAL_TRAINING_DEFAULTS, output_dir="outputs/lora", learning_rate=2e-4),
    "qlora": dict(ru.REAL_TRAINING_DEFAULTS, output_dir="outputs/qlora", learning_rate=2e-4, bf16=True),
}
RECIPE = {"full": "recipes/sft.py", "lora": "recipes/lora.py", "qlora": "recipes/qlora.py"}


def main(argv: list[str] | None = None, *, method: str = "full") -> dict:
    """Supervised fine-tuning on chat data: all weights (``full``), LoRA adapters, or LoRA on a 4-bit base."""
    # every check of the arguments, before any model is built: a refusal is printed once, no traceback (ru.run_recipe)
    with ru.checking():
        model_args, data_args, lora_args, quant_args, run_args, train_kwargs, explicit = ru.parse_recipe_args(
            (ru.ModelArguments, ru.DataArguments, ru.LoraArguments, ru.QuantArguments, ru.RunArguments),
            argv,
            embedded_defaults=EMBEDDED_DEFAULTS[method],
            real_defaults=REAL_DEFAULTS[method],
        )
        ru.cpu_test_modes(run_args)  # --fsdp_on_cpu / --model_parallel_on_cpu: tests and CPU development only
        if method == "qlora":
            ru.require_cuda(RECIPE[method])  # bitsandbytes has no CPU kernels: fail before anything is loaded
        ru.check_output_dir(train_kwargs["output_dir"], resuming=bool(train_kwargs.get("resume_from_checkpoint")))
        ru.check_model_source(model_args)  # a hub name with no hub: refused in a second, not after retries
        tokenizer = ru.load_tokenizer(model_args, chat=True)
        config = ru.model_config(model_args, tokenizer)
        seq_len = ru.resolve_seq_len(data_args.max_seq_length, config, embedded=model_args.embedded)
        peft_config = None  # the LoRA the plan is made for and the model gets
        if method != "full":
            peft_config = ru.check_lora_targets(lora_args, config, trust_remote_code=model_args.trust_remote_code)
        ru.check_dataset(data_args, kind="chat")
        request = model_args.plan_request(method, seq_len, peft_config=peft_config, async_save=run_args.async_save)
        args = ru.training_arguments(train_kwargs, explicit, config, request, nvme_path=model_args.nvme_path,
                                     deepspeed_on_cpu=run_args.deepspeed_on_cpu)  # fmt: skip
        # whole conversations packed into seq_len rows, each attending only to itself (--packing false: padded)
        packing = ru.use_packing(data_args, args, attn_implementation=model_args.attn_implementation,
                                 embedded=model_args.embedded)  # fmt: skip
        resume = ru.resume_checkpoint(args)  # --resume_from_checkpoint: checked against this run, said in one line
    if ru.is_finished(resume, args):  # the checkpoint is at the last step: nothing to train, nothing to redo
        return ru.earlier_results(args)

    load = ru.parallel_load_kwargs(args)  # the TP plan under tensor parallelism: sharded as it loads
    # the tiny embedded model is built whole, outside DeepSpeed's zero.Init (see ru.build_model)
    model = ru.build_model(model_args, config, seed=args.seed) if model_args.embedded else None
    with args.main_process_first(desc="tokenizing"):
        data = ru.chat_datasets(data_args, tokenizer, seq_len=seq_len, seed=args.seed, packing=packing,
                                batch=ru.batch_shape(args))  # fmt: skip

    # the random base must be on disk for the adapter to load later, and to be reloaded sharded (TP) or quantized
    if (method != "full" or ru.shards_at_load(load)) and model is not None:
        reload = method == "qlora" or ru.shards_at_load(load)
        model = ru.embedded_base_on_disk(model, tokenizer, model_args, args, reload=reload)
    if model is None:
        quantization = ru.bnb_config(quant_args) if method == "qlora" else None
        model = ru.build_model(model_args, config, seed=args.seed, quantization_config=quantization, **load)
    ru.print_plan(config, method=method, seq_len=seq_len, args=args, strategy=model_args.strategy,
                  trust_remote_code=model_args.trust_remote_code, peft_config=peft_config, data=data)  # fmt: skip
    before = ru.baseline_accuracy(model, tokenizer, data.task, mode="chat", args=args)
    if method != "full":
        model = ru.apply_lora(model, lora_args, quantized=method == "qlora")

    rows = "packed" if packing else "padded"
    trainer = ru.make_trainer(model, args, tokenizer, data.train, data.eval, rows=rows, seq_len=seq_len)
    ru.train(trainer, resume, async_save=run_args.async_save)
    return ru.finish_run(
        trainer, tokenizer, task=data.task, mode="chat", adapter=method != "full", before=before,
        check_export=run_args.check_export, trust_remote_code=model_args.trust_remote_code,
    )  # fmt: skip


if __name__ == "__main__":
    ru.run_recipe(main)  # a refusal: printed once by rank 0, exit 2 on every rank; then the process group torn down
