"""A minimal accelerate training loop that reports which distributed plugin really took effect.

Launched by tests/distributed/test_accelerate_configs.py with each shipped config, e.g.::

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 2 \
        --mixed_precision no tests/distributed/scripts/strategies_minimal.py --out zero2.json
    HF_DIST_FSDP_ON_CPU=1 accelerate launch --config_file accelerate_configs/fsdp2_full_shard.yaml \
        --cpu --num_processes 2 --mixed_precision no tests/distributed/scripts/strategies_minimal.py --out f.json

It trains a tiny Llama for a few fp32 steps with a plain torch AdamW and writes, from rank 0, the
accelerate distributed type, the wrapped model type, the DeepSpeed stage/offload or the FSDP
version and DTensor sharding, and the losses. On CPU it selects gloo explicitly: accelerate leaves
the backend unset for DeepSpeed when no GPU is found, and then reports a world size of 1.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from hf_dist.runtime.cpu_fsdp import enable_fsdp_on_cpu_from_env

SEED = 1234
SEQ_LEN = 32
MICRO_BATCH = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True, help="JSON report written by rank 0")
    return parser.parse_args()


def make_accelerator():
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    handlers = [InitProcessGroupKwargs(backend="gloo")] if ranks > 1 and not torch.cuda.is_available() else []
    accelerator = Accelerator(kwargs_handlers=handlers)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        # The YAML defines no batch; DeepSpeed needs one. With offload, keep the torch AdamW instead of
        # DeepSpeedCPUAdam (a C++ op JIT-compiled on first use), which DeepSpeed otherwise insists on.
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = MICRO_BATCH
        plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False
        plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
    return accelerator


def build_batches(steps: int, rank: int, vocab_size: int):
    import torch

    generator = torch.Generator().manual_seed(SEED + rank)
    start = torch.randint(0, vocab_size, (steps, MICRO_BATCH, 1), generator=generator)
    stride = torch.randint(1, 5, (steps, MICRO_BATCH, 1), generator=generator)
    return (start + stride * torch.arange(SEQ_LEN)) % vocab_size


def offload_device(offload_config) -> str:
    """'cpu'/'nvme' where DeepSpeed's engine really offloads, 'none' otherwise."""
    device = getattr(offload_config, "device", None)
    return str(getattr(device, "value", device) or "none")


def plugin_facts(accelerator, model) -> dict:
    from torch.distributed.tensor import DTensor

    state = accelerator.state
    facts = {
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "num_processes": state.num_processes,
        "mixed_precision": state.mixed_precision,
        "model_type": type(model).__name__,
    }
    fsdp_plugin = getattr(state, "fsdp_plugin", None)
    if fsdp_plugin is not None:
        facts["fsdp_version"] = fsdp_plugin.fsdp_version
        facts["reshard_after_forward"] = bool(fsdp_plugin.reshard_after_forward)
    ds_plugin = getattr(state, "deepspeed_plugin", None)
    if ds_plugin is not None:
        zero = ds_plugin.deepspeed_config["zero_optimization"]
        facts["zero_stage"] = int(model.zero_optimization_stage())
        facts["offload_optimizer"] = zero.get("offload_optimizer", {}).get("device", "none")
        facts["offload_param"] = zero.get("offload_param", {}).get("device", "none")
        facts["engine_offload_optimizer"] = offload_device(model.zero_offload_optimizer())
        facts["engine_offload_param"] = offload_device(model.zero_offload_param())
    params = list(model.parameters())
    dtensors = [p for p in params if isinstance(p, DTensor)]
    facts["dtensor_params"] = len(dtensors)
    facts["dtensor_local_numel"] = sum(p.to_local().numel() for p in dtensors)
    facts["dtensor_global_numel"] = sum(p.numel() for p in dtensors)
    zero3 = [p for p in params if hasattr(p, "ds_numel")]
    facts["zero3_params"] = len(zero3)
    facts["ds_numel"] = sum(p.ds_numel for p in zero3)
    facts["ds_partition_numel"] = sum(p.ds_tensor.numel() for p in zero3)
    facts["num_params"] = sum(p.numel() for p in params)
    return facts


def main() -> None:
    args = parse_args()
    enable_fsdp_on_cpu_from_env()
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    accelerator = make_accelerator()
    torch.manual_seed(SEED)
    # After the Accelerator, so a config with zero3_init_flag builds the model already partitioned.
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = build_batches(args.steps, accelerator.process_index, 256)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    report = {"losses": losses, **plugin_facts(accelerator, model)}
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
