"""`hf-dist plan`: which distributed strategy to use, and why, for a model on some hardware."""

from __future__ import annotations

import argparse
import json

from hf_dist.cli.common import add_positional, add_trust_remote_code, arg_kwargs
from hf_dist.planning.layout import OFFLOADS, STRATEGIES

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
    _add_model_and_hardware(parser)
    _add_layout_pins(parser)
    _add_workload(parser)
    _add_estimate_options(parser)
    _add_verification_and_output(parser)


def _add_model_and_hardware(parser: argparse.ArgumentParser) -> None:
    """What is planned for: the model, and the machines (detected where not given)."""
    add_positional(parser, "model", "hub name, local model folder or config.json")
    parser.add_argument("--gpus", type=int, help="total GPUs across all nodes (default: detected)")
    parser.add_argument("--gpu-memory", type=float, dest="gpu_memory", help="GiB per GPU (default: detected)")
    parser.add_argument("--nodes", type=int, help="number of nodes (default: from the launcher env, else 1)")
    parser.add_argument("--host-memory", type=float, dest="host_memory", help="GiB of RAM per node for CPU offload")
    parser.add_argument(
        "--nvme-gbps",
        type=float,
        dest="nvme_gbps",
        help="aggregate GB/s of each node's local NVMe drives (~3 per PCIe 4.0 drive); given, NVMe offload "
        "(ZeRO-Infinity) is considered when nothing else fits",
    )


def _add_switch(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """An ``auto``/``on``/``off`` flag: pinned on or off, or left to the planner (``_SWITCH_VALUES``)."""
    parser.add_argument(flag, choices=tuple(_SWITCH_VALUES), default="auto", help=help)


def _add_layout_pins(parser: argparse.ArgumentParser) -> None:
    """Parts of the layout the user fixes instead of the search (auto_args' and the recipes' pins)."""
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="pin the strategy (auto_args(strategy=...), the recipes' --strategy); default: searched",
    )
    parser.add_argument(
        "--offload",
        choices=OFFLOADS,
        help="pin what is offloaded to host RAM (auto_args(offload=...)); default: searched, offload only when "
        "nothing fits without it",
    )
    _add_switch(
        parser,
        "--activation-checkpointing",
        "pin activation checkpointing (auto_args(activation_checkpointing=...)); auto = chosen by the estimated "
        "tokens/s",
    )
    _add_switch(
        parser,
        "--sync-each-batch",
        "FSDP2 with gradient accumulation: reduce-scatter each micro-batch (auto_args(sync_each_batch=...)) "
        "instead of holding every unsharded gradient until the last one; auto = chosen by memory and tokens/s",
    )
    parser.add_argument(
        "--offload-device",
        choices=("cpu", "nvme"),
        dest="offload_device",
        help="pin where offloaded states go: nvme = ZeRO-Infinity (ZeRO-3; the plan states the swap files each node's "
        "drive must hold), cpu = never NVMe; default: searched",
    )
    for dim, what in (("tp", "tensor"), ("cp", "context"), ("sp", "Ulysses sequence")):
        parser.add_argument(
            f"--{dim}-size",
            type=int,
            dest=f"{dim}_size",
            help=f"pin the {what} parallel size (1 = off); default: searched when data parallelism is not enough. "
            "Pinning one size sets the others to 1 unless given",
        )


def _add_workload(parser: argparse.ArgumentParser) -> None:
    """What is trained and how: method, batch shape, optimizer, kernels."""
    parser.add_argument(
        "--method",
        choices=("full", "lora", "qlora"),
        help="what trains (default: lora when a --lora-* flag is given, else full)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        dest="seq_len",
        help="tokens per sequence (default 2048, or the model's max_position_embeddings when fewer; more than those "
        "is refused unless the config scales RoPE)",
    )
    parser.add_argument("--global-batch", type=int, dest="global_batch", help="sequences per optimizer step")
    parser.add_argument("--micro-batch", type=int, dest="micro_batch", help="sequences per rank per forward")
    parser.add_argument("--optimizer", choices=("adamw", "adamw_8bit", "sgd"), default="adamw")
    _add_lora(parser)
    _add_switch(
        parser,
        "--liger",
        "Liger kernels (use_liger_kernel): auto = considered on CUDA when liger-kernel is installed",
    )


def _add_lora(parser: argparse.ArgumentParser) -> None:
    """The LoRA planned (hf_dist.planning.lora): the recipes' (rank 16, dropout 0.05, every linear of the block)
    unless a flag says otherwise."""
    lora = "the recipes' LoRA: rank 16, dropout 0.05, q/k/v/o/gate/up/down_proj"
    parser.add_argument("--lora-rank", type=int, dest="lora_rank", help=f"LoRA rank r (default: {lora})")
    parser.add_argument(
        "--lora-dropout",
        type=float,
        dest="lora_dropout",
        help="LoRA dropout on each adapter's input; PEFT's LoraConfig defaults to 0.0, the recipes to 0.05",
    )
    parser.add_argument(
        "--lora-targets",
        nargs="+",
        dest="lora_targets",
        metavar="NAME",
        help="modules to adapt, as PEFT's target_modules: names (q_proj v_proj) or all-linear",
    )


def _add_estimate_options(parser: argparse.ArgumentParser) -> None:
    """What the estimate counts: logits, checkpoint staging, run length, safety margin, master weights."""
    parser.add_argument(
        "--fused-lm-head",
        action="store_true",
        dest="fused_lm_head",
        help="the loss runs through TRL's fused LM head (SFTTrainer): no logits held; default: the Trainer's loss",
    )

    parser.add_argument(
        "--async-save",
        action="store_true",
        dest="async_save",
        help="checkpoints staged in host RAM and written in the background (attach(trainer, async_save=True)): "
        "the staging copy counts against each node's host RAM",
    )
    parser.add_argument(
        "--train-tokens",
        type=float,
        dest="train_tokens",
        metavar="N",
        help="tokens the run trains on (e.g. 2e9): the plan then states the estimated wall time and GPU-hours of its "
        "choice and of the alternatives",
    )
    parser.add_argument("--safety-margin", type=float, default=0.1, dest="safety_margin")
    parser.add_argument(
        "--pure-bf16",
        action="store_true",
        dest="pure_bf16",
        help="plan bf16 weights and bf16 Adam state without fp32 master weights (less memory, less accurate "
        "updates); default: bf16 mixed precision with fp32 master weights and Adam state",
    )


def _add_verification_and_output(parser: argparse.ArgumentParser) -> None:
    """Loading and tracing the real model, and the output format."""
    add_trust_remote_code(parser)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="trace the chosen layout on the real model with fake tensors (seconds to a minute, no GPU) and take "
        "the next candidate if the traced memory does not fit",
    )
    parser.add_argument(
        "--verify-time-limit",
        type=float,
        default=120.0,
        dest="verify_time_limit",
        help="seconds per trace before it stops and the analytic estimate stands (default 120)",
    )
    parser.add_argument("--json", action="store_true", help="print Plan.to_dict() as JSON")


# the flags plan() takes under their own names, and plan()'s keyword -> the flag
_PLAN_OPTIONS = (
    "method", "seq_len", "optimizer", "lora_rank", "lora_dropout", "safety_margin", "fused_lm_head", "async_save",
    "train_tokens", "pure_bf16", "tp_size", "cp_size", "sp_size", "offload_device", "verify", "strategy", "offload",
)  # fmt: skip
_PLAN_RENAMED = {
    "global_batch_size": "global_batch",
    "micro_batch_size": "micro_batch",
    "verify_time_limit_s": "verify_time_limit",
}
# the hardware flags: detect_hardware()'s keyword -> the flag
_HARDWARE_OPTIONS = ("gpus", "nodes", "nvme_gbps")
_HARDWARE_RENAMED = {"gpu_memory_gib": "gpu_memory", "host_memory_gib": "host_memory"}
# on / off / auto flags: plan()'s keyword -> the flag (auto = None: searched)
_SWITCHES = {"use_liger_kernel": "liger", "activation_checkpointing": "activation_checkpointing",
             "sync_each_batch": "sync_each_batch"}  # fmt: skip
_SWITCH_VALUES = {"auto": None, "on": True, "off": False}


def run(args: argparse.Namespace) -> int:
    from hf_dist.planning.hardware import detect_hardware
    from hf_dist.planning.modelinfo import model_spec
    from hf_dist.tracing.checked_plan import plan

    # --liger on for GPUs described with --gpu-memory: the target machines have it, whatever this one has
    described = args.gpu_memory is not None and args.liger == "on"
    hardware = detect_hardware(
        liger_kernel=True if described else None,
        **arg_kwargs(args, *_HARDWARE_OPTIONS, **_HARDWARE_RENAMED),
    )
    spec = model_spec(args.model, trust_remote_code=args.trust_remote_code)
    switches = {keyword: _SWITCH_VALUES[getattr(args, flag)] for keyword, flag in _SWITCHES.items()}
    result = plan(
        spec,
        hardware=hardware,
        lora_targets=_targets(args.lora_targets),
        trust_remote_code=args.trust_remote_code,
        verify_isolate=False,  # this process plans and exits: the trace needs no worker of its own (its imports)
        **switches,
        **arg_kwargs(args, *_PLAN_OPTIONS, **_PLAN_RENAMED),
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.explain())
    return 0


def _targets(names: list[str] | None):
    """``--lora-targets``: names as a list, ``all-linear`` (one value) as PEFT's shorthand string."""
    if names is None:
        return None
    return names[0] if len(names) == 1 and names[0].lower() == "all-linear" else names
