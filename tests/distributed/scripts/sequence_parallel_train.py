"""Train a tiny Llama under DeepSpeed Ulysses SP (accelerate ``sp_backend="deepspeed"``) or in one process.

Launched by tests/distributed/test_sequence_parallel.py::

    python tests/distributed/scripts/sequence_parallel_train.py --out base.json
    ACCELERATE_USE_CPU=false torchrun --nproc_per_node 2 tests/distributed/scripts/sequence_parallel_train.py \
        --sp --out sp.json

Both runs: same init (seed 0), same 16 random sequences of 32 tokens, micro-batch 1, default Trainer
sampler (seed 42), AdamW lr 5e-5 linear, 2 steps, fp32. The SP run is ZeRO-1 with
``"sequence_parallel_size": 2`` and ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``; the 2 ranks
share one sample per step, each attending over half of its tokens after DeepSpeed's all-to-all.
Micro-batch 1 because micro-batch 2 fails in transformers' loss on CPU ranks: DeepSpeed's SP data adapter keeps each
rank's slice as a strided view there (docs/parallelism.md).
Rank 0 writes the losses, grad norms, the eval loss over 4 of the rows (not ``--packed``) and the sequence lengths
the embedding layer saw in training and in evaluation. ``--packed``:
variable-length sequences packed into the rows instead (one process: transformers' own packed-sequence mask; SP: the
document-aware sdpa over each gathered row).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_dist.atomic_io import atomic_write_json

SEQ_LEN = 32


def fixed_rows() -> list[dict]:
    import torch

    ids = torch.randint(0, 256, (16, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r.clone(), "position_ids": torch.arange(SEQ_LEN)} for r in ids]


def packed_rows(sp_size: int):
    """48 random sequences of 3 to 20 tokens packed into 32-token rows, and the collator of packed rows."""
    import random

    from datasets import Dataset

    from hf_dist.data import PackedCollator, pack

    rng = random.Random(0)
    sequences = []
    for _ in range(48):
        ids = [rng.randrange(256) for _ in range(rng.randint(3, 20))]
        sequences.append({"input_ids": ids, "labels": ids})
    return pack(Dataset.from_list(sequences), SEQ_LEN), PackedCollator(SEQ_LEN, sp_size=sp_size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sp", action="store_true")
    parser.add_argument(
        "--packed",
        action="store_true",
        help="variable-length sequences packed into the 32-token rows (hf_dist.data.pack, PackedCollator); under SP "
        "the document-aware sdpa hf_dist.data.check_packing picks, in the model and in DeepSpeed's handler",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_dist.data import check_packing
    from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs
    from hf_dist.runtime.dist import shutdown
    from hf_dist.testing import tiny_llama_config

    # packed: the attention check_packing gives a packed run (sdpa in one process, the document-aware sdpa under SP)
    attention = check_packing("sdpa", sp_size=2 if args.sp else 1) if args.packed else "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32, attn_implementation=attention)
    seen: list[int] = []
    model.model.embed_tokens.register_forward_pre_hook(lambda _m, inputs: seen.append(int(inputs[0].shape[-1])))
    dataset, collator = packed_rows(2 if args.sp else 1) if args.packed else (fixed_rows(), None)
    kwargs: dict = {"use_cpu": True}
    if args.sp:
        from accelerate import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")
        handler.sp_attn_implementation = attention  # accelerate's own check knows only its built-in names
        kwargs = {
            "deepspeed": {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 1},
                "sequence_parallel_size": 2,
            },
            "parallelism_config": ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler),
            **cpu_deepspeed_training_kwargs(),
        }
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=2,
        per_device_train_batch_size=1,
        logging_steps=1,
        save_strategy="steps" if args.sp else "no",  # the last step's ZeRO checkpoint, for hf-dist convert
        save_steps=2,
        report_to=[],
        disable_tqdm=True,
        **kwargs,
    )
    eval_dataset = None if args.packed else fixed_rows()[:4]
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset, eval_dataset=eval_dataset, data_collator=collator
    )
    trainer.train()
    train_seq_lens = sorted(set(seen))
    seen.clear()
    eval_loss = trainer.evaluate()["eval_loss"] if eval_dataset else None
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        "sp_size": trainer.get_sp_size(),
        "total_train_batch_size": trainer.get_total_train_batch_size(training_args),
        "losses": [float(e["loss"]) for e in logs],
        "grad_norms": [float(e["grad_norm"]) for e in logs],
        "embedding_seq_lens": train_seq_lens,
        "eval_seq_lens": sorted(set(seen)),
        "attn_implementation": model.config._attn_implementation,
        "eval_loss": eval_loss,
    }
    if trainer.is_world_process_zero():
        if args.sp:  # ZeRO-1 keeps whole weights in every rank's module: the reference for the conversion
            state = {k: v.detach().clone() for k, v in trainer.model_wrapped.module.state_dict().items()}
            torch.save(state, Path(args.output_dir) / "full_state_dict.pt")
        atomic_write_json(args.out, report)
    shutdown()


if __name__ == "__main__":
    main()
