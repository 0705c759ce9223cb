"""`hf-dist config`: write an accelerate YAML (or a DeepSpeed JSON) for a strategy."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hf_dist.cli.common import arg_kwargs

EPILOG = """examples:
  hf-dist config --strategy fsdp_full_shard --out fsdp.yaml
  hf-dist config --strategy zero3 --offload optimizer+params --out zero3_offload.yaml
  hf-dist config --strategy hsdp --nodes 4 --num-processes 32 --out hsdp.yaml
  hf-dist config --strategy zero2 --format deepspeed --out ds_zero2.json
  hf-dist config --strategy ddp            # print to stdout
  hf-dist config --strategy zero3 --format deepspeed --pure-bf16 --out ds_zero3_pure_bf16.json
  hf-dist config --strategy fsdp_full_shard --tp-size 2 --out fsdp2_tp2.yaml       # FSDP2 x TP
  hf-dist config --strategy fsdp_full_shard --cp-size 2 --out fsdp2_cp2.yaml       # context parallel (GPU only)
  hf-dist config --strategy zero2 --sp-size 2 --out zero2_sp2.yaml                 # DeepSpeed Ulysses SP
  hf-dist config --strategy zero2 --tp-size 2 --format deepspeed --out ds_autotp.json
  hf-dist config --strategy zero2 --tp-size 2 --deepspeed-config-file ds_autotp.json --out zero2_autotp.yaml
  hf-dist config --strategy zero3 --offload optimizer+params --offload-device nvme --nvme-path /local_nvme --format deepspeed --out ds_nvme.json

strategies: ddp, zero1, zero2, zero3, fsdp_full_shard, fsdp_shard_grad_op, hsdp
Use `hf-dist plan MODEL` to find which strategy fits your model and GPUs.
"""


HELP = "write an accelerate YAML or DeepSpeed JSON for a strategy"
DESCRIPTION = "Write an accelerate launch config (commented YAML) or a DeepSpeed JSON for a strategy."


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--tp-size", type=int, default=1, help="tensor parallel size (inside a node; default 1)")
    parser.add_argument("--cp-size", type=int, default=1, help="context parallel size (FSDP2, GPU only; default 1)")
    parser.add_argument("--sp-size", type=int, default=1, help="Ulysses sequence parallel size (ZeRO; default 1)")
    parser.add_argument("--offload-device", default="cpu", help="cpu (default) or nvme (ZeRO-3 ZeRO-Infinity)")
    parser.add_argument("--nvme-path", default=None, help="folder on a local NVMe drive (with --offload-device nvme)")
    parser.add_argument(
        "--deepspeed-config-file",
        default=None,
        help="accelerate YAML for a ZeRO strategy: reference this DeepSpeed JSON instead of inline keys (needed for "
        "AutoTP --tp-size and zero3 --sp-size; write the JSON with --format deepspeed)",
    )
    parser.add_argument("--format", choices=("accelerate", "deepspeed"), default="accelerate", help="output format")
    parser.add_argument("--out", default=None, help="file to write (default: print to stdout)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def render(args: argparse.Namespace) -> str:
    """The file text for ``args`` (pure: no I/O)."""
    from hf_dist.planning.layout import STRATEGIES, strategy
    from hf_dist.validation import check_choice

    check_choice("strategy", args.strategy, STRATEGIES, "See `hf-dist config --help`.")
    s = strategy(args.strategy)
    _check_nvme_path(args)
    if args.format == "deepspeed":
        return _render_deepspeed(args, s)
    return _render_accelerate(args, s)


# the flags both config factories take under their own names
_SHARED_OPTIONS = ("offload", "tp_size", "sp_size", "offload_device", "nvme_path")


def _render_deepspeed(args: argparse.Namespace, s) -> str:
    """The DeepSpeed JSON for a ZeRO strategy."""
    from hf_dist.configs.deepspeed import deepspeed_config

    if not s.is_deepspeed:
        raise ValueError(
            f"--format deepspeed needs a ZeRO strategy (zero1, zero2, zero3), got {args.strategy!r}; "
            "use --format accelerate for ddp/FSDP."
        )
    if args.cp_size > 1:
        raise ValueError(
            f"--cp-size {args.cp_size} with {args.strategy}: context parallelism runs only with FSDP2; use "
            "--sp-size (DeepSpeed Ulysses) with a ZeRO strategy, or --strategy fsdp_full_shard --format accelerate"
        )
    if args.num_processes is not None:  # the planner's checks on the job's size (the JSON does not carry it)
        from hf_dist.planning.layout import Layout

        Layout(args.strategy, args.num_processes, args.nodes, args.offload, tp_size=args.tp_size,
               sp_size=args.sp_size, offload_device=args.offload_device)  # fmt: skip
    cfg = deepspeed_config(args.strategy, **arg_kwargs(args, *_SHARED_OPTIONS, "mixed_precision", "pure_bf16"))
    return json.dumps(cfg, indent=2) + "\n"


def _render_accelerate(args: argparse.Namespace, s) -> str:
    """The commented accelerate YAML, its header naming the choices that differ from the defaults."""
    from hf_dist.configs.accelerate import accelerate_config, header_for, to_yaml

    if args.deepspeed_config_file is not None and not s.is_deepspeed:
        raise ValueError(f"--deepspeed-config-file needs a ZeRO strategy (zero1, zero2, zero3), got {args.strategy!r}")
    if args.deepspeed_config_file is not None:
        _check_deepspeed_json(args)
    mixed_precision, note = _pure_bf16_accelerate(args, s) if args.pure_bf16 else (args.mixed_precision, "")
    options = arg_kwargs(args, *_SHARED_OPTIONS, "nodes", "num_processes", "activation_checkpointing", "cp_size")
    cfg = accelerate_config(
        args.strategy,
        mixed_precision=mixed_precision,
        wrap_classes=args.wrap_class,
        deepspeed_config_file=args.deepspeed_config_file,
        **options,
    )
    name = Path(args.out).name if args.out else "config.yaml"
    return to_yaml(cfg, header_for(name, _shown_in_header(args), path=args.out or name) + note)


def _shown_in_header(args: argparse.Namespace) -> dict[str, Any]:
    """The choices the YAML's header names: the strategy and every option not at its default."""
    shown = {"strategy": args.strategy}
    if args.offload != "none":
        shown["offload"] = args.offload
    if args.offload_device != "cpu":
        shown.update(offload_device=args.offload_device, nvme_path=args.nvme_path)
    if args.nodes != 1:
        shown["nodes"] = args.nodes
    for key in ("tp_size", "cp_size", "sp_size"):
        if getattr(args, key) != 1:
            shown[key] = getattr(args, key)
    if args.deepspeed_config_file is not None:
        shown["deepspeed_config_file"] = args.deepspeed_config_file
    return shown


def _check_nvme_path(args: argparse.Namespace) -> None:
    if args.nvme_path is not None and args.offload_device != "nvme":
        raise ValueError(
            f"--nvme-path {args.nvme_path} is used only with --offload-device nvme (got --offload-device "
            f"{args.offload_device}, which would drop it); add --offload-device nvme (zero3 with --offload optimizer "
            "or optimizer+params), or drop --nvme-path"
        )


def _check_deepspeed_json(args: argparse.Namespace) -> None:
    """The JSON the YAML names must exist (accelerate reads it at launch) and carry the sizes asked for here."""
    path = Path(args.deepspeed_config_file)
    write = f"`hf-dist config --strategy {args.strategy} --tp-size {args.tp_size} --sp-size {args.sp_size} " \
            f"--format deepspeed --out {path}`"  # fmt: skip
    if not path.is_file():
        raise ValueError(
            f"--deepspeed-config-file {path} does not exist (accelerate reads it at launch); write it first: {write}"
        )
    from hf_dist.configs.overrides import read_json_config
    from hf_dist.runtime.dist import parallel_sizes

    cfg = read_json_config("--deepspeed-config-file", path)
    tp, sp = parallel_sizes(None, cfg)["tp"], cfg.get("sequence_parallel_size", 1)
    if (tp, sp) != (args.tp_size, args.sp_size):
        raise ValueError(
            f"--deepspeed-config-file {path}\n"
            f"  has autotp_size {tp} and sequence_parallel_size {sp}, but this config asks for --tp-size "
            f"{args.tp_size} --sp-size {args.sp_size}: the run would not be what the YAML says.\n"
            f"  Rewrite the JSON with {write}, or pass the sizes it has"
        )


def _pure_bf16_accelerate(args: argparse.Namespace, s) -> tuple[str, str]:
    """(mixed_precision for the YAML, header note) for --pure-bf16 --format accelerate."""
    from hf_dist.configs.accelerate import pure_bf16_yaml

    if args.mixed_precision != "bf16":
        raise ValueError(
            f"--pure-bf16 keeps bf16 weights and Adam state and needs --mixed-precision bf16, got "
            f"{args.mixed_precision!r}; drop --mixed-precision or --pure-bf16."
        )
    return pure_bf16_yaml(s)


def run(args: argparse.Namespace) -> int:
    text = render(args)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    from hf_dist.atomic_io import atomic_write_text
    from hf_dist.checkpoint.output.paths import check_output_path

    check_output_path(args.out, overwrite=args.force, what="--out", overwrite_flag="--force", is_dir=False)
    path = atomic_write_text(args.out, text)
    print(f"wrote {path}", file=sys.stderr)
    return 0
