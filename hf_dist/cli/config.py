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
        cfg = deepspeed_config(args.strategy, offload=args.offload, mixed_precision=args.mixed_precision)
        return json.dumps(cfg, indent=2) + "\n"

    from hf_dist.configs.accelerate import accelerate_config, header_for, to_yaml

    cfg = accelerate_config(
        args.strategy,
        offload=args.offload,
        nodes=args.nodes,
        num_processes=args.num_processes,
        mixed_precision=args.mixed_precision,
        wrap_classes=args.wrap_class,
        activation_checkpointing=args.activation_checkpointing,
    )
    shown = {"strategy": args.strategy}
    if args.offload != "none":
        shown["offload"] = args.offload
    if args.nodes != 1:
        shown["nodes"] = args.nodes
    name = Path(args.out).name if args.out else "config.yaml"
    return to_yaml(cfg, header_for(name, shown))


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
