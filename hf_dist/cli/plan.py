"""`hf-dist plan`: which distributed strategy to use, and why, for a model on some hardware."""

from __future__ import annotations

import argparse
import dataclasses
import json

from hf_dist.cli.common import add_positional, add_trust_remote_code
from hf_dist.planning.request import add_request_flags, request_from_args

EPILOG = """examples:
  hf-dist plan meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80
  hf-dist plan ./my-model/config.json --gpus 16 --nodes 2 --gpu-memory 80 --global-batch 128
  hf-dist plan ./my-model --gpus 1 --gpu-memory 24 --method lora --seq-len 4096
  hf-dist plan ./my-model --gpus 1 --gpu-memory 80 --lora-rank 64 --lora-dropout 0 --lora-targets q_proj v_proj
  hf-dist plan ./my-model --gpus 8 --gpu-memory 80 --json > plan.json
  hf-dist plan ./my-model --gpus 1 --gpu-memory 80 --global-batch 64 --liger off   # without Liger kernels
  hf-dist plan ./my-model --gpus 8 --gpu-memory 80 --pure-bf16   # bf16 weights and Adam state
  hf-dist plan ./my-model --gpus 8 --gpu-memory 80 --seq-len 8192 --fused-lm-head   # TRL's SFTTrainer loss
  hf-dist plan ./my-model --gpus 8 --gpu-memory 80 --global-batch 64 --train-tokens 2e9   # wall time, GPU-hours
  hf-dist plan ./my-model --gpus 8 --gpu-memory 80 --host-memory 512 --async-save   # count the staging copy
  hf-dist plan ./llama-3.1-8b --gpus 8 --gpu-memory 80 --seq-len 131072 --global-batch 8   # long context: cp/sp
  hf-dist plan ./llama-3-70b --gpus 64 --nodes 8 --gpu-memory 80 --global-batch 16   # fewer sequences than GPUs
  hf-dist plan ./llama-3-70b --gpus 8 --gpu-memory 80 --host-memory 256 --nvme-gbps 12   # may offload to NVMe
  hf-dist plan ./llama-3-70b --gpus 8 --gpu-memory 80 --offload-device nvme   # ZeRO-Infinity: swap files per node
  hf-dist plan ./my-model --gpus 8 --gpu-memory 80 --tp-size 2   # pin a size (the others become 1)
  hf-dist plan ./my-model --gpus 8 --gpu-memory 80 --strategy zero3   # pin the strategy, as auto_args(strategy=)
  hf-dist plan ./my-model --gpus 8 --gpu-memory 24 --strategy zero3 --offload optimizer --activation-checkpointing on
  hf-dist plan ./my-model --gpus 64 --nodes 8 --gpu-memory 80 --verify   # check the pick by tracing the real model
  hf-dist plan ./custom-model --gpus 8 --gpu-memory 80 --trust-remote-code   # import its auto_map code (trusted)
"""


HELP = "pick the fastest distributed strategy that fits, with per-rank memory by component"
DESCRIPTION = (
    "Estimate per-rank memory for every strategy (DDP, ZeRO-1/2/3, FSDP2, HSDP, offload, "
    "activation checkpointing; tensor / context / sequence parallelism and NVMe offload when data parallelism "
    "is not enough) and pick the fastest that fits. Hardware is detected unless given."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``MODEL``, one flag per :class:`~hf_dist.planning.request.PlanRequest` field (its help text, listed by
    section), ``--trust-remote-code`` and ``--json``."""
    add_positional(parser, "model", "hub name, local model folder or config.json")
    add_request_flags(parser)
    add_trust_remote_code(parser)
    parser.add_argument("--json", action="store_true", help="print Plan.to_dict() as JSON")


def run(args: argparse.Namespace) -> int:
    from hf_dist.planning.hardware import detect_hardware
    from hf_dist.planning.modelinfo import model_spec
    from hf_dist.tracing.checked_plan import plan

    # --liger on for GPUs described with --gpu-memory: the target machines have it, whatever this one has
    described = args.gpu_memory_gib is not None and args.use_liger_kernel == "on"
    request = request_from_args(args)
    hardware = detect_hardware(liger_kernel=True if described else None, **request.hardware_keywords())
    spec = model_spec(args.model, trust_remote_code=args.trust_remote_code)
    # verify_isolate=False: this process plans and exits, so the trace needs no worker of its own (its imports)
    result = plan(spec, dataclasses.replace(request, hardware=hardware), verify_isolate=False)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.explain())
    return 0
