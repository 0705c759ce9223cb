"""Run the tracer's preparation on real tensors on every rank and measure rank 0's real peak of live tensors.

    torchrun --nproc_per_node 2 tests/distributed/scripts/trace_real.py OUT.json SETUP_JSON [SETUP_JSON ...]

Each SETUP_JSON is a ``hf_dist.tracing.TraceSetup`` as a dict. The model is built, checkpointed and sharded by
``hf_dist.tracing.prepare`` (the same functions the trace runs), then given real storage, wrapped in torch's real
DDP (its C++ Reducer) where the layout is DDP, given the optimizer state as the trace makes it
(``create_optimizer_state``) and trained for the tracer's step (``_train_steps``) over gloo.
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
from hf_dist.tracing import TraceSetup, prepare
from hf_dist.tracing.trace import _train_steps, create_optimizer_state


def measure(setup: TraceSetup, mesh) -> int:
    gc.collect()  # the previous setup's model and optimizer: their frees inside this profile would count as negative
    config = tiny_llama_config()
    optimizer_cls, optimizer_kwargs = prepare.trainer_optimizer(setup)
    model = prepare.shard(prepare.enable_checkpointing(prepare.build_model(config, setup), setup), setup, mesh)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.02)
        model = prepare.materialize(model)
        if setup.layout.strategy.is_ddp and setup.world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        model = prepare.autocast_forward(model, setup)
        optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
        create_optimizer_state(model, optimizer)  # as the trace makes it, before its measured step
        with record_function("steps"), prepare.cuda_dropout():  # the kernel the trace assumes (a GPU's)
            no_tracker = types.SimpleNamespace(reset_mod_stats=lambda: None)
            _train_steps(model, optimizer, setup, config.vocab_size, lambda phase: None, no_tracker)
    curve, marks = memory_curve(prof)
    start, end = marks["steps"]
    return max(live for t, live in curve if start <= t <= end)


def main() -> None:
    out, *setups = sys.argv[1:]
    track_all_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    peaks = [measure(TraceSetup.from_dict(json.loads(text)), mesh) for text in setups]
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(peaks, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
