"""Run the tracer's preparation on real tensors on every rank and measure rank 0's real peak of live tensors.

    torchrun --nproc_per_node 2 tests/distributed/scripts/trace_real.py OUT.json SETUP_JSON [SETUP_JSON ...]

Each SETUP_JSON is a ``hf_dist.tracing.TraceSetup`` as a dict. The model is built, checkpointed and sharded by
``hf_dist.tracing.prepare`` (the same functions the trace runs), then given real storage, wrapped in torch's real
DDP (its C++ Reducer) where the layout is DDP, given the optimizer state as the trace makes it
(``create_optimizer_state``) and trained for the tracer's step (``_train_steps``) over gloo. A DeepSpeed layout starts
the real engine instead (``hf_dist.tracing.zero.start_engine``: the same config and the Trainer's optimizer, without the
tracer's shims) and runs the same steps through it (``zero.train_steps``).
Everything from the model's storage on runs under torch's profiler with every thread counted
(``hf_dist.testing.track_all_threads``); the peak of live tensor bytes in the steps is what the trace predicts.
"""

from __future__ import annotations

import gc
import json
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

from hf_dist.testing import memory_curve, tiny_llama_config, track_all_threads
from hf_dist.tracing import TraceSetup, prepare, zero
from hf_dist.tracing.trace import _train_steps, create_optimizer_state


def measure(setup: TraceSetup, mesh) -> int:
    gc.collect()  # the previous setup's model and optimizer: their frees inside this profile would count as negative
    config = tiny_llama_config()
    optimizer_spec = prepare.trainer_optimizer(setup)
    model = prepare.shard(prepare.enable_checkpointing(prepare.build_model(config, setup), setup), setup, mesh)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = prepare.materialize(model)
        torch.manual_seed(0)
        _initialize(model)
        if setup.layout.strategy.is_deepspeed:
            run = _deepspeed(model, optimizer_spec, setup, config.vocab_size)
        else:
            run = _torch(model, optimizer_spec, setup, config.vocab_size)
        with record_function("steps"), prepare.cuda_dropout():  # the kernel the trace assumes (a GPU's)
            run()
    curve, marks = memory_curve(prof)
    start, end = marks["steps"]
    return max(live for t, live in curve if start <= t <= end)


def _initialize(model) -> None:
    """Real values where the empty storage has none, so the steps are healthy (DeepSpeed skips a step whose gradient
    norm is not finite): small random weights, and the rotary ``inv_freq`` buffers of a freshly built rotary module
    (a finite loss needs them)."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
        for module in model.modules():
            if hasattr(module, "original_inv_freq"):
                fresh = type(module)(module.config)
                module.inv_freq.copy_(fresh.inv_freq)
                module.original_inv_freq.copy_(fresh.original_inv_freq)


def _torch(model, optimizer_spec, setup: TraceSetup, vocab_size: int):
    if setup.layout.strategy.is_ddp and setup.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
    model = prepare.autocast_forward(model, setup)
    optimizer_cls, optimizer_kwargs = optimizer_spec
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
    create_optimizer_state(model, optimizer)  # as the trace makes it, before its measured step
    no_tracker = types.SimpleNamespace(reset_mod_stats=lambda: None)
    return lambda: _train_steps(model, optimizer, setup, vocab_size, lambda phase: None, no_tracker)


def _deepspeed(model, optimizer_spec, setup: TraceSetup, vocab_size: int):
    engine = zero.start_engine(model, zero.trainer_optimizer(model, optimizer_spec), setup)

    def run() -> None:
        zero.train_steps(engine, setup, vocab_size, lambda phase: None, lambda: None)
        engine.destroy()  # the next setup's engine starts clean (ZeRO-3's hooks, the comm groups' buffers)

    return run


def main() -> None:
    out, *setups = sys.argv[1:]
    track_all_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    peaks = []
    for text in setups:
        # nothing of the last setup may be freed while this one is measured (a dip in the live bytes): its engine's
        # cycles are collected, and both ranks are past its last collective, before the profiler starts
        dist.barrier()
        while gc.collect():  # a second pass frees what the first one's finalizers released (DeepSpeed's engine)
            pass
        dist.barrier()
        with zero.process_functions_restored():  # each setup runs as in a process of its own
            peaks.append(measure(TraceSetup.from_dict(json.loads(text)), mesh))
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(peaks, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
