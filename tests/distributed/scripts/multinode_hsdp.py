"""One rank of a simulated multi-node run: report the topology and, with HSDP, the device mesh it trained on.

Launched on loopback by tests/distributed/test_multinode.py as two "nodes" (two launcher processes):

    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P \
        multinode_hsdp.py --mode torch --out OUT          # and --node_rank 1 in a second shell
    accelerate launch --config_file accelerate_configs/hsdp_2node.yaml --num_processes 4 \
        --parallelism_config_dp_shard_size 2 --machine_rank 0 --main_process_ip 127.0.0.1 \
        multinode_hsdp.py --mode accelerate --out OUT      # and --machine_rank 1

    deepspeed --hostfile HOSTFILE --no_ssh --node_rank 0 --master_addr 127.0.0.1 --master_port P \
        multinode_hsdp.py --mode deepspeed --out OUT      # and --node_rank 1: DeepSpeed's hostfile launcher

Each rank writes OUT/rank{R}.json: its node, its shard and replicate groups, the placements of a sharded
parameter, and a checksum of its local shard after one optimizer step (equal within a replicate group);
with DeepSpeed, its ZeRO-3 partition instead.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from hf_dist.runtime.dist import shutdown


def tiny_model():
    import torch
    from transformers import LlamaForCausalLM

    from hf_dist.testing import tiny_llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def torch_hsdp(model, replicate: int, shard: int):
    """Plain torch: a (replicate, shard) mesh, FSDP2 per decoder layer, HSDP by passing the 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def accelerate_hsdp(model):
    """accelerate: FSDP plugin and parallelism config come from the YAML via the launcher's environment."""
    import torch
    from accelerate import Accelerator

    from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu

    enable_fsdp_on_cpu()  # accelerate would otherwise drop FSDP on CPU and run plain DDP
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    mesh = accelerator.torch_device_mesh["dp_replicate", "dp_shard"]
    return model, optimizer, mesh, str(accelerator.distributed_type)


def one_step(model, optimizer) -> None:
    import torch

    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))  # different data per rank
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def ddp_report(out: str, node_rank: int) -> None:
    """The multi-node DDP YAML: every rank sees the whole world and a collective spans both nodes."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), reduction="sum")
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "node_rank": node_rank,
        "local_rank": accelerator.local_process_index,
        "distributed_type": str(accelerator.distributed_type),
        "all_reduce_sum": float(total.item()),
    }
    Path(out, f"rank{report['rank']}.json").write_text(json.dumps(report))
    shutdown()


def deepspeed_report(out: str) -> None:
    """DeepSpeed's launcher: ZeRO-3 across the two nodes, one optimizer step, each rank's parameter partition."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    weight = engine.module.model.layers[0].self_attn.q_proj.weight
    total = torch.tensor([engine.global_rank + 1.0])
    torch.distributed.all_reduce(total)
    report = {
        "rank": engine.global_rank,
        "world_size": engine.world_size,
        "node_rank": int(os.environ["CROSS_RANK"]),
        "nodes": int(os.environ["CROSS_SIZE"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "zero_stage": engine.zero_optimization_stage(),
        "full_numel": weight.ds_numel,
        "partition_numel": weight.ds_tensor.numel(),
        "all_reduce_sum": float(total.item()),
    }
    Path(out, f"rank{report['rank']}.json").write_text(json.dumps(report))
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["torch", "accelerate", "ddp", "deepspeed"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--local_rank", type=int, help="passed by the deepspeed launcher (also in $LOCAL_RANK)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if args.mode == "deepspeed":
        return deepspeed_report(args.out)
    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "-1")))
    if args.mode == "ddp":
        return ddp_report(args.out, node_rank)
    model = tiny_model()
    if args.mode == "torch":
        dist.init_process_group("gloo")
        model, mesh = torch_hsdp(model, replicate=args.nodes, shard=world // args.nodes)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        dist_type = "torch"
    else:
        model, optimizer, mesh, dist_type = accelerate_hsdp(model)
    one_step(model, optimizer)

    weight = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(weight, DTensor), type(weight)
    report = {
        "rank": dist.get_rank(),
        "world_size": world,
        "local_world_size": per_node,
        "node_rank": node_rank,
        "distributed_type": dist_type,
        "model_type": type(model).__name__,
        "mesh_dim_names": list(mesh.mesh_dim_names),
        "mesh_shape": list(mesh.shape),
        "mesh": mesh.mesh.tolist(),
        "shard_group": dist.get_process_group_ranks(mesh.get_group("dp_shard")),
        "replicate_group": dist.get_process_group_ranks(mesh.get_group("dp_replicate")),
        "placements": [str(p) for p in weight.placements],
        "local_shard_sum": float(weight.to_local().detach().double().sum()),
        "local_shard_numel": weight.to_local().numel(),
    }
    Path(args.out, f"rank{report['rank']}.json").write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
