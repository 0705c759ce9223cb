"""Train a tiny Llama with the HF Trainer under TP, FSDP2 x TP or DDP on CPU ranks and record what ran.

Launched by tests/distributed/test_tensor_parallel.py, e.g.::

    torchrun --nproc_per_node 2 tests/distributed/scripts/tensor_parallel_train.py --layout ddp ...
    torchrun --nproc_per_node 2 tests/distributed/scripts/tensor_parallel_train.py --layout tp ...
    torchrun --nproc_per_node 4 tests/distributed/scripts/tensor_parallel_train.py --layout fsdp_tp ...

Every layout loads the same saved tiny Llama (``--model-dir``, written once by rank 0) and trains on
the same global batch per optimizer step, in dataset order, fp32:

* ``ddp``: 2 ranks, micro-batch 2 each (global 4);
* ``tp``: 2 ranks, ``from_pretrained(**hf_dist.from_pretrained_kwargs(layout))`` (``distributed_config={"tp_plan":
  "auto", "tp_size": 2}``) + ``ParallelismConfig(tp_size=2)``; both ranks
  see the same micro-batch of 4 (the TP group is one data-parallel replica);
* ``fsdp_tp``: 4 ranks, ``from_pretrained(**hf_dist.from_pretrained_kwargs(layout))`` (``distributed_config`` with
  ``tp_size=2, fsdp_size=2``: transformers applies TP and FSDP2 at load time) + ``ParallelismConfig(dp_shard_size=2, tp_size=2)``;
  micro-batch 2 per data-parallel rank (global 4);
* ``autotp``: 2 ranks, DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": 2}``, ZeRO-2, the config
  ``hf_dist.configs.deepspeed_config`` writes), the plain model sharded by DeepSpeed when the engine starts;
  micro-batch 4 shared by the TP group. The report lists DeepSpeed's TP layers and their local weight shapes.

CPU shim (tests and CPU development only, ``hf_dist.runtime.cpu_fsdp``): accelerate's ``ParallelismConfig._validate_accelerator`` refuses any
parallelism config on ``DistributedType.MULTI_CPU`` ("ParallelismConfig is only compatible
DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got
DistributedType.MULTI_CPU."), although nothing after that check needs a GPU: a model sharded at load
time is not wrapped again by the Trainer. :func:`allow_parallelism_config_on_cpu` lets that one check
treat a distributed CPU run like a multi-device one. Nothing else is patched.

Rank 0 writes a JSON report: per-step losses, the DTensor placements/mesh/local shape of every
parameter, and (``--save``) the files of the Trainer checkpoint and of a DCP save of the model's
state dict, next to the gathered full state dict (``full_state_dict.pt``) to compare them with.

Checkpoints: ``--save-steps N`` saves ``checkpoint-N`` every N steps with hf_dist's
``ShardedResumeCallback`` (the optimizer and scheduler of a model sharded at load, which the Trainer cannot
save) and ``CompleteCheckpointCallback``, added with ``hf_dist.callbacks.attach``; ``--resume auto`` resumes
from ``hf_dist.auto_resume(output_dir, training_args=...)``, the way the recipes do, ``--resume PATH`` from PATH.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# the same learnable sequences as the strategy runs, and their packed rows (a sibling script)
from strategies_train import DATA, build_dataset, data_and_collator

from hf_dist.atomic_io import atomic_write_json

SEED = 1234
GLOBAL_BATCH = 4
NUM_SAMPLES = 64  # the first GLOBAL_BATCH * steps are used, in order


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", required=True, choices=["ddp", "tp", "fsdp_tp", "autotp"])
    parser.add_argument("--model-dir", required=True, help="the tiny Llama; rank 0 writes it if absent")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--save", action="store_true", help="after training: a DCP save of the model + the gathered full state dict"
    )
    parser.add_argument("--save-steps", type=int, default=0, help="save checkpoint-N every N steps (0: never)")
    parser.add_argument(
        "--resume", help="'auto' (the newest complete checkpoint in --output-dir) or a checkpoint path"
    )
    parser.add_argument("--out", required=True, help="JSON report written by rank 0")
    parser.add_argument(
        "--data",
        choices=DATA[:2],
        default="fixed",
        help="packed: strategies_train.py's packed rows (one global batch)",
    )
    return parser.parse_args(argv)


def write_model(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    if (folder / "config.json").exists():
        return
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32)
    model.save_pretrained(folder)


def load_model(layout: str, folder: Path):
    """(model, extra TrainingArguments kwargs, micro-batch) for one layout."""
    import torch
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM

    if layout == "ddp":
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), {}, GLOBAL_BATCH // 2
    if layout == "autotp":
        from hf_dist.configs.deepspeed import deepspeed_config

        ds = deepspeed_config("zero2", tp_size=2, mixed_precision="no")
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), {"deepspeed": ds}, GLOBAL_BATCH
    import hf_dist
    from hf_dist.planning.layout import Layout

    # what hf_dist tells a user to load with, for the layout the Trainer's ParallelismConfig runs
    if layout == "tp":
        load = hf_dist.from_pretrained_kwargs(Layout("ddp", 2, tp_size=2, mixed_precision="no"))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **load)
        return model, {"parallelism_config": ParallelismConfig(tp_size=2)}, GLOBAL_BATCH
    load = hf_dist.from_pretrained_kwargs(Layout("fsdp_full_shard", 4, tp_size=2, mixed_precision="no"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **load)
    return model, {"parallelism_config": ParallelismConfig(dp_shard_size=2, tp_size=2)}, GLOBAL_BATCH // 2


def placements(model) -> dict:
    """Every parameter: DTensor placements, mesh dims/shape, global and local shape (None for plain tensors)."""
    from torch.distributed.tensor import DTensor

    facts = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            facts[name] = {
                "placements": [repr(p) for p in param.placements],
                "mesh_dims": list(param.device_mesh.mesh_dim_names or ()),
                "mesh_shape": list(param.device_mesh.shape),
                "shape": list(param.shape),
                "local_shape": list(param.to_local().shape),
            }
        else:
            facts[name] = None
    return facts


def tp_layers(module) -> dict:
    """DeepSpeed's tensor-parallel layers (``module_inject.layers``): class, TP group size, local weight shape."""
    return {
        name: {"class": type(m).__name__, "tp_world_size": m.tp_world_size, "local_shape": list(m.weight.shape)}
        for name, m in module.named_modules()
        if hasattr(m, "tp_world_size") and getattr(m, "weight", None) is not None
    }


def autotp_full_state_dict(module) -> dict:
    """The whole weights of an AutoTP model, gathered by layer class (not from the checkpoint's own split rules):
    ``LinearAllreduce`` (row-parallel) along dim 1, DeepSpeed's other TP layers along dim 0, the rest whole."""
    import torch
    import torch.distributed as dist

    full = {}
    for name, tensor in module.state_dict().items():
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        if hasattr(owner, "tp_world_size") and tensor.dim() > 0:
            pieces: list = [None] * dist.get_world_size(owner.mp_group)
            dist.all_gather_object(pieces, tensor.detach().clone(), group=owner.mp_group)
            tensor = torch.cat(pieces, dim=1 if type(owner).__name__ == "LinearAllreduce" else 0)
        full[name] = tensor.detach().clone()
    return full


def main(argv: list[str] | None = None) -> None:
    """One Trainer run; the process group stays up (scripts/runs.py runs several in one launch)."""
    args = parse_args(argv)
    import hashlib

    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_dist.callbacks import CompleteCheckpointCallback, ShardedResumeCallback, attach
    from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
    from hf_dist.runtime.cpu_fsdp import allow_parallelism_config_on_cpu

    allow_parallelism_config_on_cpu()
    if args.layout == "autotp":  # accelerate's DeepSpeed state over gloo, before any other state exists
        from hf_dist.runtime.cpu_fsdp import cpu_deepspeed_training_kwargs

        cpu_kwargs = cpu_deepspeed_training_kwargs()
    else:
        cpu_kwargs = {"use_cpu": True}
    state = PartialState()  # the gloo process group
    model_dir = Path(args.model_dir)
    if state.is_main_process:
        write_model(model_dir)
    dist.barrier()  # the model folder is complete before any rank loads it
    model, extra, micro_batch = load_model(args.layout, model_dir)

    losses: list[float] = []

    rng_states: list[str] = []

    class Recorder(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

        def on_step_end(self, _args, _state, _control, **kwargs):
            # the torch RNG as each step ends, then one draw, as dropout would: a resume must restore the generators
            rng_states.append(hashlib.sha1(torch.random.get_rng_state().numpy().tobytes()).hexdigest()[:16])
            torch.rand(1)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=micro_batch,
        learning_rate=args.lr,
        lr_scheduler_type="linear",  # a schedule with state, so a resume must restore it
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        # A model sharded at load time may only save its weights (the Trainer refuses optimizer state);
        # hf_dist's ShardedResumeCallback adds the optimizer and scheduler.
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or args.steps,
        save_only_model=args.layout in ("tp", "fsdp_tp"),
        report_to=[],
        seed=SEED,
        data_seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        **cpu_kwargs,
        **extra,
    )
    dataset, collator = build_dataset(NUM_SAMPLES, model.config.vocab_size), None
    if args.data == "packed":
        dataset, collator = data_and_collator("packed", model.config.vocab_size, GLOBAL_BATCH, args.steps)
    resume = auto_resume(args.output_dir, training_args=training_args) if args.resume == "auto" else args.resume
    trainer = Trainer(
        model=model, args=training_args, train_dataset=dataset, data_collator=collator, callbacks=[Recorder()]
    )
    attach(trainer, [ShardedResumeCallback(), CompleteCheckpointCallback()])
    trainer.train(resume_from_checkpoint=resume)

    accel = trainer.accelerator
    report = {
        "layout": args.layout,
        "resumed_from": resume,
        "world_size": accel.num_processes,
        "losses": losses,
        "distributed_type": str(accel.distributed_type).split(".")[-1],
        "model_wrapped": type(trainer.model_wrapped).__name__,
        "loaded_by_transformers": bool(getattr(model, "is_distributed_loading_by_transformers", False)),
        "total_train_batch_size": trainer.get_total_train_batch_size(training_args),
        "tp_size": trainer.get_tp_size(),
        "placements": placements(trainer.model),
        "tp_layers": tp_layers(trainer.model),
        "rng_at_step_end": rng_states,
        "local_params": sum(getattr(p, "_local_tensor", p).numel() for p in trainer.model.parameters()),
    }
    if args.save and args.layout == "autotp":  # the reference for hf-dist convert of the AutoTP checkpoint
        full = autotp_full_state_dict(trainer.model)
        if state.is_main_process:
            torch.save(full, Path(args.output_dir) / "full_state_dict.pt")
            root = Path(args.output_dir) / f"checkpoint-{args.steps}"
            report["checkpoint_files"] = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    elif args.save:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.tensor import DTensor

        out_dir = Path(args.output_dir)
        state_dict = trainer.model.state_dict()
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state_dict.items()}
        dcp.save({"model": state_dict}, checkpoint_id=str(out_dir / "dcp"))
        if state.is_main_process:
            torch.save(full, out_dir / "full_state_dict.pt")
            root = out_dir / f"checkpoint-{args.steps}"
            if root.is_dir():  # the last checkpoint's files
                report["checkpoint_files"] = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
            report["dcp_files"] = sorted(p.name for p in (out_dir / "dcp").iterdir())
        dist.barrier()
    if state.is_main_process:
        atomic_write_json(args.out, report)


if __name__ == "__main__":
    from hf_dist.runtime.dist import shutdown

    main()
    shutdown()
