"""`hf-dist config`: write an accelerate YAML (or a DeepSpeed JSON) for a strategy."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EPILOG = """examples:
  hf-dist config --strategy fsdp_full_shard --out fsdp.yaml
  hf-dist config --strategy zero3 --offload optimizer+params --out zero3_offload.yaml
  hf-dist config --strategy hsdp --nodes 4 --num-processes 32 --out hsdp.yaml
  hf-dist config --strategy zero2 --format deepspeed --out ds_zero2.json
  hf-dist config --strategy ddp            # print to stdout
  hf-dist config --strategy zero3 --format deepspeed --pure-bf16 --out ds_zero3_pure_bf16.json

strategies: ddp, zero1, zero2, zero3, fsdp_full_shard, fsdp_shard_grad_op, hsdp
Use `hf-dist plan MODEL` to find which strategy fits your model and GPUs.
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "config",
        help="write an accelerate YAML or DeepSpeed JSON for a strategy",
        description="Write an accelerate launch config (commented YAML) or a DeepSpeed JSON for a strategy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # No `choices=`: run() validates so the error lists the allowed values in hf_dist's own words.
    parser.add_argument("--strategy", required=True, help="ddp, zero1, zero2, zero3, fsdp_full_shard, ...")
    parser.add_argument("--offload", default="none", help="none (default), optimizer, optimizer+params")
    parser.add_argument("--nodes", type=int, default=1, help="number of machines (default 1)")
    parser.add_argument("--num-processes", type=int, default=None, help="total processes over all nodes")
    parser.add_argument("--mixed-precision", default="bf16", help="bf16 (default), fp16, no")
    parser.add_argument("--wrap-class", action="append", default=None, help="FSDP block class (repeatable)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="FSDP activation checkpointing")
    parser.add_argument(
        "--pure-bf16",
        action="store_true",
        dest="pure_bf16",
        help="bf16 weights and bf16 Adam state, no fp32 master weights (needs --mixed-precision bf16 and a model "
        "loaded in bf16; ZeRO needs --format deepspeed)",
    )
    parser.add_argument("--format", choices=("accelerate", "deepspeed"), default="accelerate", help="output format")
    parser.add_argument("--out", default=None, help="file to write (default: print to stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    parser.set_defaults(func=run)
    return parser


def render(args: argparse.Namespace) -> str:
    """The file text for ``args`` (pure: no I/O)."""
    from hf_dist.configs import STRATEGIES, check_choice

    check_choice("strategy", args.strategy, STRATEGIES, "See `hf-dist config --help`.")
    if args.format == "deepspeed":
        from hf_dist.configs.deepspeed import deepspeed_config

        if not args.strategy.startswith("zero"):
            raise ValueError(
                f"--format deepspeed needs a ZeRO strategy (zero1, zero2, zero3), got {args.strategy!r}; "
                "use --format accelerate for ddp/FSDP."
            )
        cfg = deepspeed_config(
            args.strategy, offload=args.offload, mixed_precision=args.mixed_precision, pure_bf16=args.pure_bf16
        )
        return json.dumps(cfg, indent=2) + "\n"

    from hf_dist.configs.accelerate import accelerate_config, header_for, to_yaml

    mixed_precision, note = _pure_bf16_accelerate(args) if args.pure_bf16 else (args.mixed_precision, "")
    cfg = accelerate_config(
        args.strategy,
        offload=args.offload,
        nodes=args.nodes,
        num_processes=args.num_processes,
        mixed_precision=mixed_precision,
        wrap_classes=args.wrap_class,
        activation_checkpointing=args.activation_checkpointing,
    )
    shown = {"strategy": args.strategy}
    if args.offload != "none":
        shown["offload"] = args.offload
    if args.nodes != 1:
        shown["nodes"] = args.nodes
    name = Path(args.out).name if args.out else "config.yaml"
    return to_yaml(cfg, header_for(name, shown) + note)


def _pure_bf16_accelerate(args: argparse.Namespace) -> tuple[str, str]:
    """(mixed_precision for the YAML, header note) for --pure-bf16 --format accelerate."""
    if args.mixed_precision != "bf16":
        raise ValueError(
            f"--pure-bf16 keeps bf16 weights and Adam state and needs --mixed-precision bf16, got "
            f"{args.mixed_precision!r}; drop --mixed-precision or --pure-bf16."
        )
    if args.strategy.startswith("zero"):
        raise ValueError(
            f"--pure-bf16 with {args.strategy} needs DeepSpeed's bf16_master_weights_and_grads and "
            "bf16_optimizer_states, which accelerate's inline DeepSpeed keys cannot set; write a JSON with "
            f"`hf-dist config --strategy {args.strategy} --format deepspeed --pure-bf16 --out ds.json` and pass it as "
            "TrainingArguments(deepspeed='ds.json') (or hf_dist.auto_args(model, pure_bf16=True))."
        )
    if args.strategy == "ddp":
        return (
            "bf16",
            "\nPure bf16: load the model with dtype=torch.bfloat16; DDP then keeps bf16 weights and Adam state.",
        )
    # accelerate upcasts FSDP2 parameters to fp32 whenever mixed_precision != "no"
    return "no", (
        "\nPure bf16: load the model with dtype=torch.bfloat16. mixed_precision is 'no' on purpose: with bf16, "
        "accelerate\nupcasts the FSDP2 shards to fp32 (fp32 master weights and Adam state); the bf16 weights set "
        "the compute dtype."
    )


def run(args: argparse.Namespace) -> int:
    text = render(args)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    from hf_dist.checkpoint.paths import check_output_path
    from hf_dist.configs.accelerate import atomic_write_text

    check_output_path(args.out, overwrite=args.force, what="--out", overwrite_flag="--force", is_dir=False)

    path = atomic_write_text(args.out, text, force=args.force)
    print(f"wrote {path}", file=sys.stderr)
    return 0
