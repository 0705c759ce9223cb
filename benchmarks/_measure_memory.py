"""Measure per-rank training memory by component on CPU ranks (launched by planner_accuracy.py).

Usage: torchrun --nproc_per_node=2 benchmarks/_measure_memory.py STRATEGY OUT.json NAME:HIDDEN:INTER:LAYERS:HEADS:KV:VOCAB ...

STRATEGY is a registry name, or ``ddp+tp2``: tensor parallelism over both ranks (transformers'
``from_pretrained(distributed_config={"tp_plan": "auto"})``, the model's own Llama plan; no data parallelism, so no DDP wrapper), or
``fsdp_full_shard+tp2`` on 4 ranks: FSDP2 x TP, both applied by transformers at load
(``hf_dist.configs.training_args.load_kwargs``: ``tp_size=2, fsdp_size=world // 2``), the ``(fsdp, tp)`` mesh of the
Trainer's runs, or
``zero2+tp2`` (ZeRO-1/2): DeepSpeed AutoTP over both ranks (``"tensor_parallel": {"autotp_size": 2}``; the plain
model is sharded when the engine starts), or ``zero1+sp2`` (any ZeRO stage): DeepSpeed Ulysses over both ranks, set up as accelerate does it
(``UlyssesSPAttentionHF.register_with_transformers`` -> the engine's ``mpu``); each rank feeds its half of every
sequence (input ids, positions and pre-shifted labels, what DeepSpeed's ``UlyssesSPDataLoaderAdapter`` hands it), or
``zero3+nvme``: ZeRO-Infinity with hf_dist's DeepSpeed settings (optimizer and parameters offloaded to NVMe, swap
files under ``$HF_DIST_MEASURE_DIR``); its row adds the host buffers DeepSpeed pins for it (``host``: the optimizer
swapper's buffers, the fp32 gradient partition, the parameter swapper's buffers and the 16-bit parameters kept in
host memory, read from DeepSpeed's own objects: they are allocated outside torch's allocator) and this rank's swap
files (``swap``).

For each model: one warm-up step (creates the optimizer state), then a measured step:
- tensor walk (storages de-duplicated): parameters (local shards; ZeRO-3 ``ds_tensor``), optimizer state
  (+ DeepSpeed's fp32 master partitions), gradients (``.grad`` of the local params, or the ZeRO
  engine's gradient partitions) read between backward and step;
- peak: torch.profiler(profile_memory=True) records every CPU tensor allocation/free from model creation
  on, each with the process-wide live tensor bytes (counted in every thread: :func:`track_all_threads`); their
  maximum inside the measured step is the peak.
Training is fp32 (no mixed precision on CPU), AdamW, seq 128, micro-batch 2.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from hf_dist.configs.training_args import load_kwargs
from hf_dist.planning.features import installed_features
from hf_dist.planning.layout import strategy as registry_strategy
from hf_dist.testing import memory_curve, track_all_threads

SEQ, MICRO = 128, 2


def parse_layout(layout: str) -> tuple[str, int, int]:
    """``zero1+sp2`` -> ("zero1", tp 1, sp 2); ``fsdp_full_shard+tp2`` -> ("fsdp_full_shard", 2, 1); ``+nvme``: see
    :func:`is_nvme`."""
    strategy, *dims = layout.removesuffix("+nvme").split("+")
    sizes = {"tp": 1, "sp": 1}
    for dim in dims:
        if dim[:2] not in sizes or not dim[2:].isdigit():
            raise ValueError(f"unknown layout {layout!r}: expected STRATEGY, STRATEGY+tpN or STRATEGY+spN")
        sizes[dim[:2]] = int(dim[2:])
    return strategy, sizes["tp"], sizes["sp"]


def is_nvme(layout: str) -> bool:
    """``zero3+nvme``: ZeRO-3 offloading optimizer and parameters to NVMe (ZeRO-Infinity)."""
    return layout.endswith("+nvme")


def nvme_config(folder: str) -> dict:
    """hf_dist's ZeRO-Infinity settings for a fp32 run with a torch optimizer, as a raw DeepSpeed config."""
    from hf_dist.configs.deepspeed import deepspeed_config

    planned = deepspeed_config(
        "zero3",
        offload="optimizer+params",
        mixed_precision="no",
        cpu_adam=False,
        offload_device="nvme",
        nvme_path=folder,
    )
    keep = ("zero_optimization", "aio", "zero_force_ds_cpu_optimizer")
    return {k: v for k, v in planned.items() if k in keep}


def nvme_host_tensors(module, engine) -> list:
    """The host buffers ZeRO-Infinity allocates (DeepSpeed 0.19 attribute names)."""
    ds = engine.optimizer
    out = list(ds.optimizer_swapper.swap_buffer_manager.all_buffers) + [ds.grad_partitions_flat_buffer]
    out += [t for t in ds.param_groups_fp16_flat_cpu_memory if t.numel() > 1]  # 1-element placeholders otherwise
    swapper = getattr(next(module.parameters()), "nvme_swapper", None)
    return out + ([swapper.buffers] if swapper is not None else [])


def swap_bytes(folder: str) -> int:
    """This rank's swap files under ``folder`` (``zero_stage_3/*/rankR/``)."""
    from pathlib import Path

    rank = f"rank{dist.get_rank()}"
    return sum(p.stat().st_size for p in Path(folder).rglob("*.swp") if rank in p.parts)


def build(spec: str, tp_size: int = 1, fsdp_size: int = 1):
    from transformers import AutoModelForCausalLM, LlamaConfig

    name, h, inter, layers, heads, kv, vocab = spec.split(":")
    config = LlamaConfig(
        hidden_size=int(h), intermediate_size=int(inter), num_hidden_layers=int(layers),
        num_attention_heads=int(heads), num_key_value_heads=int(kv), vocab_size=int(vocab),
        max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    if tp_size == 1:
        return name, config, AutoModelForCausalLM.from_config(config)
    # a TP model is sharded as it loads: rank 0 writes it once, every rank loads its shards (the whole model is
    # never alive in a rank at the same time as its shards)
    folder = os.path.join(os.environ.get("HF_DIST_MEASURE_DIR", "."), f"tp_model_{name}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    dist.barrier()
    # what hf_dist hands from_pretrained for the layout (fp32 here: no FSDP mixed-precision policy)
    sharding = load_kwargs(tp_size, 1, deepspeed=False, features=installed_features(), fsdp_size=fsdp_size)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **sharding)
    compact_cpu_shards(model)
    return name, config, model


def compact_cpu_shards(model) -> None:
    """transformers' TP loader slices each row-sharded (``Shard(0)``) weight out of the loaded tensor and moves it
    to the target device; on a GPU that copy holds only the slice, on CPU the move is a no-op and the local shard
    stays a view of the whole weight's storage (measured: every q/k/v/gate/up/embedding shard holds 2x its
    bytes on 2 ranks). Copy such views, so the CPU run holds what a GPU run does."""
    for param in model.parameters():
        local = getattr(param, "_local_tensor", param)  # the DTensor's own local tensor, not an alias of it
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():
            if local is param:
                param.data = param.data.clone()
            else:
                param._local_tensor = local.clone()


def storage_key(t: torch.Tensor):
    if hasattr(t, "to_local"):  # DTensor (FSDP2): the local shard is what this rank holds
        t = t.to_local()
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else None


def keys(tensors) -> set:
    return {k for t in tensors if isinstance(t, torch.Tensor) and (k := storage_key(t)) is not None}


def nbytes(keyset: set) -> int:
    return sum(size for _, size in keyset)


def wrap(strategy: str, model, tp_size: int = 1, sp_size: int = 1, nvme: str | None = None):
    """Returns (module, optimizer, step_fn(ids, probe)), probe called between backward and step; under SP ``ids`` is
    the whole sequence and the step feeds this rank's slice."""
    s = registry_strategy(strategy)
    if tp_size > 1 and not s.is_deepspeed:  # sharded at load (TP, or FSDP2 x TP): nothing left to wrap
        module = model
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    elif s.is_ddp:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    elif s.is_fsdp:  # full shard: every decoder layer and the root
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        module = fully_shard(model)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    else:
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": s.zero_stage},
            "steps_per_print": 10**9,
        }
        if tp_size > 1:
            config["tensor_parallel"] = {"autotp_size": tp_size}
        if nvme:
            config.update(nvme_config(nvme))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        mpu = None
        if sp_size > 1:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            config["sequence_parallel_size"] = sp_size
            deepspeed.init_distributed()  # what deepspeed.initialize would start; the SP groups need it first
            mpu = UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp_size,
                micro_batch_size=MICRO, seq_length=SEQ, seq_length_is_variable=True,
            )  # fmt: skip
        engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)

        def ds_step(ids, probe):
            if sp_size > 1:  # this rank's slice of ids, positions and pre-shifted labels
                shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
                chunk = SEQ // sp_size
                part = slice(dist.get_rank() % sp_size * chunk, (dist.get_rank() % sp_size + 1) * chunk)
                positions = torch.arange(SEQ).expand(ids.shape[0], -1)
                local = {
                    k: v[:, part].contiguous()
                    for k, v in (("input_ids", ids), ("position_ids", positions), ("shift_labels", shift))
                }
                loss = engine(**local, labels=local["shift_labels"]).loss  # labels: the model computes a loss at all
            else:
                loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            probe()
            engine.step()

        return engine, optimizer, ds_step

    def step(ids, probe):
        loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        probe()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return module, optimizer, step


def param_tensors(module) -> list:
    out = []
    for p in module.parameters():
        out.append(getattr(p, "ds_tensor", p))  # ZeRO-3 keeps the local partition in ds_tensor
    return out


def optimizer_tensors(optimizer) -> list:
    base = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the torch optimizer
    out = [t for state in base.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    # DeepSpeed's fp32 master partitions are the torch optimizer's parameters
    if base is not optimizer:
        out += [p for group in base.param_groups for p in group["params"]]
    return out


def grad_tensors(module, optimizer) -> list:
    out = [p.grad for p in module.parameters() if p.grad is not None]
    for name in ("averaged_gradients", "grads_in_partition", "fp32_partitioned_groups_flat"):
        value = getattr(optimizer, name, None)
        if name == "fp32_partitioned_groups_flat":
            out += [t.grad for t in value or [] if t.grad is not None]
        elif isinstance(value, dict):
            out += [t for ts in value.values() for t in (ts or [])]
        elif isinstance(value, list):
            out += [t for t in value if isinstance(t, torch.Tensor)]
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out


def measure(layout: str, spec: str) -> dict:
    """Everything from model creation on runs under the profiler, so its allocation stream is the absolute
    tensor memory of this run (including C++-only tensors such as DDP buckets that a gc walk cannot see), counted
    across every thread (:func:`track_all_threads`)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    strategy, tp_size, sp_size = parse_layout(layout)
    fsdp_size = dist.get_world_size() // tp_size if tp_size > 1 and registry_strategy(strategy).is_fsdp else 1
    loaded_sharded = tp_size > 1 and not registry_strategy(strategy).is_deepspeed  # AutoTP shards after the load
    seen = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        name, config, model = build(spec, tp_size if loaded_sharded else 1, fsdp_size)
        nvme = os.environ["HF_DIST_MEASURE_DIR"] if is_nvme(layout) else None
        module, optimizer, step = wrap(strategy, model, tp_size, sp_size, nvme)
        # every rank of a TP or SP group sees the same sequence; data-parallel ranks see different ones
        generator = torch.Generator().manual_seed(dist.get_rank() // (tp_size * sp_size))
        ids = torch.randint(0, config.vocab_size, (MICRO, SEQ), generator=generator)
        step(ids, lambda: None)  # warm-up: optimizer state exists from now on
        params = keys(param_tensors(module))
        optim = keys(optimizer_tensors(optimizer)) - params
        gc.collect()

        def probe():
            seen["grads"] = keys(grad_tensors(module, optimizer)) - params - optim

        with record_function("measured_step"):
            step(ids, probe)
    curve, marks = memory_curve(prof)
    start_ns, end_ns = marks["measured_step"]
    before = [live for t, live in curve if t < start_ns]
    resident = before[-1] if before else 0
    in_step = [live for t, live in curve if start_ns <= t <= end_ns] or [resident]
    partitioned = registry_strategy(strategy).zero_stage == 3  # ZeRO-3 leaves empty placeholders in the module
    host = {"host": nbytes(keys(nvme_host_tensors(module, module))), "swap": swap_bytes(nvme)} if nvme else {}
    return {
        **host,
        "model": name,
        "strategy": layout,
        "num_params": None if partitioned or tp_size > 1 else sum(p.numel() for p in model.parameters()),
        "params": nbytes(params),
        "optimizer": nbytes(optim),
        "grads": nbytes(seen["grads"]),
        "resident_before_step": resident,
        "peak": max(in_step),
        "step_ms": (end_ns - start_ns) / 1e6,
    }


def main() -> None:
    strategy, out, *specs = sys.argv[1:]
    track_all_threads()
    if not registry_strategy(parse_layout(strategy)[0]).is_deepspeed:  # DeepSpeed starts its own process group
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = [measure(strategy, spec) for spec in specs]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        # report the larger of the two ranks per field (ranks can differ by a padding element)
        merged = []
        for per_rank in zip(*gathered, strict=True):
            row = dict(per_rank[0])
            for key in ("params", "optimizer", "grads", "resident_before_step", "peak", "host", "swap"):
                if key in row:
                    row[key] = max(r[key] for r in per_rank)
            merged.append(row)
        tmp = out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(merged, fh, indent=1)
        os.replace(tmp, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
