"""Train a tiny Llama with the HF Trainer under one strategy and record what really ran.

Launched by tests/distributed/test_strategies.py, e.g.::

    python tests/distributed/scripts/strategies_train.py --strategy none --grad-accum 2 --out base.json
    HF_DIST_FSDP_ON_CPU=1 torchrun --nproc_per_node 2 tests/distributed/scripts/strategies_train.py \
        --strategy fsdp_full_shard --out fsdp.json
    HF_DIST_FSDP_ON_CPU=1 torchrun --nproc_per_node 2 tests/distributed/scripts/strategies_train.py \
        --strategy fsdp_full_shard --micro-batch 1 --grad-accum 2 --sync-each-batch --out sync.json

Everything is fp32 on CPU: bf16 autocast on CPU is slow and would blur the loss comparison.
The data are fixed-length random token ids (no padding), fed in order, so one process with
gradient accumulation 2 sees exactly the samples that 2 ranks with accumulation 1 see per step.
Rank 0 writes a JSON report: per-step losses, the wrapper types, accelerate's distributed type,
proof of sharding (DTensor shards for FSDP, ZeRO-3 partitioned numel) and the checkpoint files, and how often the
Trainer turned FSDP2's gradient sync off (``no_sync_calls``) next to the plugin's ``sync_each_batch``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu_from_env
from hf_dist.runtime.dist import shutdown

SEED = 1234
SEQ_LEN = 32
DATA = ("fixed", "packed", "padded")
# --data packed/padded: sequence lengths that best-fit-decreasing packs into 4 rows of SEQ_LEN, three with a padded
# tail (29+2, 24+8, 20+10, 18+14): one global batch of 2 ranks x micro-batch 2 (or 1 process x 2 x accumulation 2)
VARIABLE_LENGTHS = (24, 8, 20, 10, 18, 14, 29, 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", required=True, help="'none' (single process) or an hf_dist strategy")
    parser.add_argument("--offload", default="none")
    parser.add_argument("--offload-device", default="cpu", help="cpu, or nvme (ZeRO-Infinity) with --nvme-path")
    parser.add_argument("--nvme-path", help="folder for ZeRO-Infinity's swap files")
    parser.add_argument("--vocab-size", type=int, default=256, help="embedded tiny Llama's vocabulary")
    parser.add_argument("--save-steps", type=int, help="default: --steps (one checkpoint, at the end)")
    parser.add_argument("--resume", action="store_true", help="resume from hf_dist.auto_resume(--output-dir)")
    parser.add_argument(
        "--resume-from",
        help="resume from this checkpoint as given, under hf_dist.callbacks.attach and nothing else (no early check); "
        "a refusal (UnsafePickleError, PathEscapeError) is reported instead of raised",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument(
        "--sync-each-batch",
        action="store_true",
        help="plan FSDP2 to reduce-scatter every micro-batch (hf_dist.auto_args(sync_each_batch=True))",
    )
    parser.add_argument(
        "--data",
        choices=DATA,
        default="fixed",
        help="fixed: full-length rows; packed: variable-length sequences packed (hf_dist.data.pack, PackedCollator) "
        "into exactly one global batch of rows, so every step sees all of them whatever the layout; padded: the same "
        "sequences padded per micro-batch (run it with micro-batch x accumulation = their number)",
    )
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--out", required=True, help="JSON report written by rank 0")
    return parser.parse_args(argv)


def build_model(vocab_size: int):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    # Built before TrainingArguments so ZeRO-3 does not switch on zero.Init: every run starts from
    # bit-identical weights, and the engine partitions them afterwards.
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=vocab_size), dtype=torch.float32)


def build_dataset(num_samples: int, vocab_size: int):
    import torch

    # Random arithmetic progressions mod vocab: learnable in a few steps, so the loss falls fast and
    # a wrong gradient (missing all-reduce, double-counted shard) shows up in the trajectory.
    generator = torch.Generator().manual_seed(SEED)
    start = torch.randint(0, vocab_size, (num_samples, 1), generator=generator)
    stride = torch.randint(1, 5, (num_samples, 1), generator=generator)
    ids = (start + stride * torch.arange(SEQ_LEN)) % vocab_size
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def variable_length_sequences(vocab_size: int) -> list[dict]:
    """Arithmetic progressions of VARIABLE_LENGTHS (the conversations of --data packed / padded)."""
    import torch

    generator = torch.Generator().manual_seed(SEED)
    rows = []
    for n in VARIABLE_LENGTHS:
        start, stride = (
            torch.randint(0, vocab_size, (1,), generator=generator),
            torch.randint(1, 5, (1,), generator=generator),
        )
        ids = ((start + stride * torch.arange(n)) % vocab_size).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def data_and_collator(mode: str, vocab_size: int, global_batch: int, steps: int):
    """(train dataset, collator) of --data: fixed rows (default collator), packed rows, or padded sequences."""
    if mode == "fixed":
        return build_dataset(global_batch * steps, vocab_size), None
    from datasets import Dataset

    from hf_dist.data import PackedCollator, pack

    sequences = Dataset.from_list(variable_length_sequences(vocab_size))
    if mode == "padded":
        return sequences, pad_collator
    rows = pack(sequences, SEQ_LEN)
    if rows.num_rows != global_batch:
        raise SystemExit(f"--data packed makes {rows.num_rows} rows: run it with a global batch of {rows.num_rows}")
    return rows, PackedCollator(SEQ_LEN)


def pad_collator(features: list[dict]) -> dict:
    """Sequences padded to the longest of the micro-batch: pad 0, label -100, attention mask 0."""
    import torch

    width = max(len(f["input_ids"]) for f in features)
    batch = {"input_ids": [], "labels": [], "attention_mask": []}
    for f in features:
        pad = width - len(f["input_ids"])
        batch["input_ids"].append(f["input_ids"] + [0] * pad)
        batch["labels"].append(f["labels"] + [-100] * pad)
        batch["attention_mask"].append([1] * len(f["input_ids"]) + [0] * pad)
    return {k: torch.tensor(v) for k, v in batch.items()}


def training_kwargs(model, args: argparse.Namespace, world_size: int) -> dict:
    """TrainingArguments kwargs: the hf_dist path (auto_args) for a strategy, plain Trainer for 'none'."""
    common = dict(
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps or args.steps,
        save_only_model=False,
        report_to=[],
        seed=SEED,
        data_seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=False,
        fp16=False,
    )
    if args.strategy == "none":
        return {
            **common,
            "use_cpu": True,
            "per_device_train_batch_size": args.micro_batch,
            "gradient_accumulation_steps": args.grad_accum,
        }
    import hf_dist

    sync = {}
    if args.sync_each_batch:  # the plan accumulates only when its global batch says so
        sync = {"sync_each_batch": True, "global_batch_size": args.micro_batch * args.grad_accum * world_size}
    auto = hf_dist.auto_args(
        model,
        strategy=args.strategy,
        seq_len=SEQ_LEN,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum,
        bf16=False,
        fp16=False,
        engine_on_cpu=True,  # FSDP2 / ZeRO on these CPU ranks (tests only)
        **sync,
        **hardware_kwargs(args.offload, world_size, args.offload_device, args.nvme_path),
    )
    # use_cpu from auto_args: the DDP launch has no ACCELERATE_USE_CPU (conftest); engine_on_cpu: DeepSpeed over gloo
    return {**auto, **common}


def in_order_trainer() -> tuple[type, dict]:
    """(Trainer class, TrainingArguments kwargs) that feed the samples in dataset order, probed.

    Newer transformers have ``train_sampling_strategy="sequential"``; 5.0 has no such option, so its
    Trainer gets a ``SequentialSampler`` directly (accelerate shards the batches across ranks either way).
    """
    import dataclasses

    from torch.utils.data import SequentialSampler
    from transformers import Trainer, TrainingArguments

    if "train_sampling_strategy" in {f.name for f in dataclasses.fields(TrainingArguments)}:
        return Trainer, {"train_sampling_strategy": "sequential"}

    class InOrderTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    return InOrderTrainer, {}


def hardware_kwargs(offload: str, world_size: int, device: str = "cpu", nvme_path: str | None = None) -> dict:
    """Planner keywords: this CPU, except for offload, which the planner refuses on CPU hardware.

    Offload moves states to host RAM, which is pointless when training already runs there, so
    ``plan()`` rejects it for ``device="cpu"``. To exercise the offload code path the plan is made
    for GPUs (without bf16: the run is fp32) and the resulting DeepSpeed config is run on CPU ranks,
    with a torch optimizer (``cpu_adam=False``) so DeepSpeedCPUAdam is not JIT-compiled.
    """
    if offload == "none":
        return {"gpus": world_size, "offload": "none"}
    from hf_dist.planning.hardware import Hardware

    hardware = Hardware(device="cuda", gpus_per_node=world_size, gpu_memory_gib=80.0, bf16=False)
    nvme = {"offload_device": "nvme", "nvme_path": nvme_path} if device == "nvme" else {}
    return {"hardware": hardware, "offload": offload, "cpu_adam": False, **nvme}


class LossRecorder:
    """Collects the loss the Trainer logs at each optimizer step (already averaged over ranks)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        recorder = self

        class _Callback(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    recorder.losses.append(float(logs["loss"]))

        self.losses: list[float] = []
        self.callback = _Callback()


def sharding_facts(trainer) -> dict:
    """What the parameters look like after wrapping: DTensor shards (FSDP2) or ZeRO-3 partitions."""
    from torch.distributed.tensor import DTensor

    params = list(trainer.model_wrapped.parameters())
    facts: dict = {"num_param_tensors": len(params)}
    dtensors = [p for p in params if isinstance(p, DTensor)]
    facts["dtensor_params"] = len(dtensors)
    if dtensors:
        facts["dtensor_placements"] = sorted({str(p.placements) for p in dtensors})
        facts["dtensor_global_numel"] = sum(p.numel() for p in dtensors)
        facts["dtensor_local_numel"] = sum(p.to_local().numel() for p in dtensors)
    zero3 = [p for p in params if hasattr(p, "ds_numel")]
    facts["zero3_params"] = len(zero3)
    if zero3:
        facts["ds_numel"] = sum(p.ds_numel for p in zero3)
        facts["ds_partition_numel"] = sum(p.ds_tensor.numel() for p in zero3)
        facts["local_numel"] = sum(p.numel() for p in zero3)
    return facts


class NVMeProbe:
    """What ZeRO-Infinity holds after each optimizer step (before that step's save): the optimizer state and fp32
    master partitions still resident in host memory, and this rank's swap files under ``nvme_path``."""

    def __init__(self, nvme_path: str) -> None:
        from transformers import TrainerCallback

        probe, self.root, self.steps = self, Path(nvme_path), {}

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, optimizer=None, **kwargs):
                from hf_dist.checkpoint.lifecycle.zero_infinity import zero_infinity_optimizer

                probe.steps[state.global_step] = probe.facts(zero_infinity_optimizer(optimizer))

        self.callback = _Callback()

    def facts(self, optimizer) -> dict:
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        files = {
            str(p.relative_to(self.root)): p.stat().st_size
            for p in sorted(self.root.rglob("*.swp"))
            if f"rank{rank}" in p.parts
        }
        states = optimizer.optimizer.state.values()
        return {
            "resident_state_numel": sum(
                v.numel() for s in states for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
            ),
            "resident_master_numel": sum(t.numel() for t in optimizer.fp32_partitioned_groups_flat),
            "master_numel_per_group": [int(n) for n in optimizer.fp16_partitioned_groups_flat_numel],
            "swap_files": files,
        }


class NoSyncCounter:
    """Counts FSDP2's ``set_requires_gradient_sync(False)`` on the root module: accelerate's ``no_sync``, which the
    Trainer enters on every micro-batch but the last unless the plugin's ``sync_each_batch`` is set."""

    def __init__(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.calls, original = 0, FSDPModule.set_requires_gradient_sync

        def counted(module, requires_gradient_sync, *args, **kwargs):
            self.calls += not requires_gradient_sync
            return original(module, requires_gradient_sync, *args, **kwargs)

        FSDPModule.set_requires_gradient_sync = counted


def engine_facts(trainer) -> dict:
    wrapped = trainer.model_wrapped
    facts = {"model_wrapped": type(wrapped).__name__, "model": type(trainer.model).__name__}
    if hasattr(wrapped, "zero_optimization_stage"):
        facts["zero_stage"] = int(wrapped.zero_optimization_stage())
        device = getattr(wrapped.zero_offload_optimizer(), "device", None)
        facts["zero_offload_optimizer"] = str(getattr(device, "value", device) or "none")
        param = getattr(wrapped.zero_offload_param(), "device", None)
        facts["zero_offload_param"] = str(getattr(param, "value", param) or "none")
        facts["optimizer"] = type(wrapped.optimizer).__name__
    return facts


def checkpoint_layout(output_dir: str) -> list[str]:
    root = Path(output_dir)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def report_refusal(trainer, checkpoint: str, out: str) -> None:
    """Resume ``checkpoint`` under ``attach``; rank 0 reports what was refused (every rank must refuse alike)."""
    from hf_dist.callbacks import attach
    from hf_dist.checkpoint.safety.errors import UnsafePickleError
    from hf_dist.checkpoint.safety.paths import PathEscapeError

    attach(trainer, callbacks=[])
    try:
        trainer.train(resume_from_checkpoint=checkpoint)
        report = {"refused": None, "global_step": trainer.state.global_step}
    except (UnsafePickleError, PathEscapeError) as exc:
        report = {"refused": type(exc).__name__, "message": str(exc)}
    if trainer.is_world_process_zero():
        Path(out).write_text(json.dumps(report))


def main(argv: list[str] | None = None) -> None:
    """One Trainer run; the process group stays up (scripts/runs.py runs several in one launch)."""
    args = parse_args(argv)
    enable_fsdp_on_cpu_from_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = build_model(args.vocab_size)
    kwargs = training_kwargs(model, args, world_size)

    from transformers import TrainingArguments

    Trainer, sampling = in_order_trainer()
    kwargs.update(sampling)
    training_args = TrainingArguments(**kwargs)
    global_batch = args.micro_batch * args.grad_accum * world_size
    dataset, collator = data_and_collator(args.data, model.config.vocab_size, global_batch, args.steps)
    recorder = LossRecorder()
    callbacks = [recorder.callback]
    probe = NVMeProbe(args.nvme_path) if args.offload_device == "nvme" else None
    callbacks += [probe.callback] if probe else []
    resume = None
    if args.resume:
        import hf_dist

        resume = hf_dist.auto_resume(args.output_dir, training_args=training_args)
        from hf_dist.callbacks import ZeroInfinityResumeCallback  # in hf_dist.callbacks.default(), as recipes use

        callbacks.append(ZeroInfinityResumeCallback())
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collator, callbacks=callbacks
    )
    no_sync = NoSyncCounter()
    if args.resume_from:
        report_refusal(trainer, args.resume_from, args.out)
        return
    if resume:
        from hf_dist.callbacks import attach

        attach(trainer, callbacks=[])  # the resume's loads guarded, as every hf_dist resume is
    trainer.train(resume_from_checkpoint=resume)
    facts = {**engine_facts(trainer), **sharding_facts(trainer)}
    state = trainer.accelerator.state
    report = {
        "strategy": args.strategy,
        "losses": recorder.losses,
        "world_size": state.num_processes,
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
        "global_batch": global_batch,
        "data": args.data,
        "training_args": {k: v for k, v in kwargs.items() if isinstance(v, str | int | float | bool)},
        "resumed_from": resume,
        "nvme": probe.steps if probe else None,
        "sync_each_batch": trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False),
        "no_sync_calls": no_sync.calls,
        **facts,
    }
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():
        report["checkpoint_files"] = checkpoint_layout(args.output_dir)
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
    shutdown()
