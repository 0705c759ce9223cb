"""The device mesh of an accelerate YAML, fitted to the allocation a multi-node launch really got.

A YAML's ``parallelism_config`` fixes the data-parallel sizes for one cluster shape: ``hsdp_2node.yaml`` says
``dp_replicate_size: 2``, ``dp_shard_size: 8`` (2 nodes x 8 GPUs = 16 ranks), and accelerate rejects the mesh on
every rank when the launch starts any other number (``sbatch --nodes 4`` starts 32). :func:`mesh_flags` keeps what
the YAML chose about the model (its ``tp``/``cp``/``sp`` sizes) and derives the data-parallel sizes from the
allocation: HSDP (a YAML with ``dp_replicate_size > 1``) replicates across the nodes and shards inside each node
(``dp_replicate = nodes``, ``dp_shard = GPUs per node / (tp x cp x sp)``); any other mesh shards over every rank
(``dp_shard = nodes x GPUs per node / (tp x cp x sp)``). The result is accelerate launch flags, which override the
YAML. A model-parallel group that does not divide the ranks, or an FSDP mesh left with nothing to shard (HSDP on
one GPU per node), is refused in one line.

``python -m hf_dist.configs.launch_mesh CONFIG NODES GPUS_PER_NODE`` prints the flags on one line (nothing for a
YAML without a mesh); on a mesh that cannot fit it prints one line to stderr and exits 2. The SLURM scripts in
examples/slurm/ call it before ``srun``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PREFIX = "parallelism_config_"
MODEL_DIMS = ("tp", "cp", "sp")


class MeshMismatch(ValueError):
    """The YAML's model-parallel sizes cannot be laid over the allocation."""


def _size(mesh: dict[str, Any], dim: str) -> int:
    value = mesh.get(f"{PREFIX}{dim}_size", mesh.get(f"{dim}_size", 1))
    return int(value or 1)


def mesh_flags(config: dict[str, Any], nodes: int, gpus_per_node: int, *, name: str = "the config") -> list[str]:
    """accelerate launch flags that fit ``config``'s mesh to ``nodes`` x ``gpus_per_node`` ranks ([] without one)."""
    mesh = config.get("parallelism_config") or {}
    if not mesh:
        return []
    if nodes < 1 or gpus_per_node < 1:
        raise MeshMismatch(f"{name}: {nodes} node(s) x {gpus_per_node} GPU(s) per node is no allocation")
    model = 1
    for dim in MODEL_DIMS:
        model *= _size(mesh, dim)
    world = nodes * gpus_per_node
    split = " x ".join(f"{dim} {_size(mesh, dim)}" for dim in MODEL_DIMS)
    hsdp = _size(mesh, "dp_replicate") > 1
    ranks, where = (gpus_per_node, "GPUs per node (HSDP shards inside a node)") if hsdp else (world, "ranks")
    if ranks % model:
        raise MeshMismatch(
            f"{name}: its model-parallel group ({split} = {model} ranks) does not divide the {ranks} {where} of "
            f"{nodes} node(s) x {gpus_per_node} GPU(s); change --gpus-per-node or the YAML's sizes"
        )
    replicate, shard = (nodes, gpus_per_node // model) if hsdp else (1, world // model)
    if config.get("distributed_type") == "FSDP" and shard == 1 and _size(mesh, "cp") == 1:
        raise MeshMismatch(
            f"{name}: FSDP over {nodes} node(s) x {gpus_per_node} GPU(s) leaves a dp_shard of 1 (after {split}): "
            "nothing to shard, which accelerate refuses; use more GPUs per node or a DDP config "
            "(accelerate_configs/multi_node_template.yaml)"
        )
    return [f"--{PREFIX}dp_replicate_size", str(replicate), f"--{PREFIX}dp_shard_size", str(shard)]


def main(argv: list[str] | None = None) -> int:
    import yaml

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m hf_dist.configs.launch_mesh CONFIG NODES GPUS_PER_NODE", file=sys.stderr)
        return 2
    path, nodes, gpus = args
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
        flags = mesh_flags(config, int(nodes), int(gpus), name=path)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    print(" ".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
