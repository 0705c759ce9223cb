"""`hf-dist convert`: a DeepSpeed ZeRO / FSDP (DCP) / Trainer checkpoint -> an HF folder (or HF -> DCP)."""

from __future__ import annotations

import argparse

from hf_dist.cli.common import add_checkpoint_paths, add_trust_remote_code, arg_kwargs

EPILOG = """examples:
  hf-dist convert out/checkpoint-500 out/hf-model                     # ZeRO-1/2/3 or FSDP, detected
  hf-dist convert out/checkpoint-500/global_step500 out/hf-model      # the inner folder works too
  hf-dist convert out/checkpoint-500 out/hf-fp32 --dtype fp32 --max-shard-size 2GB
  hf-dist convert ds_ckpt/ out/hf-model --tag global_step200 --model-config base-model/ --tokenizer base-model/
  hf-dist convert out/checkpoint-500 out/lora-adapter --adapter       # PEFT run -> adapter folder
  hf-dist convert out/checkpoint-500 out/merged --merge-adapter       # PEFT run -> merged full model
  hf-dist convert out/hf-model out/init-dcp --to dcp                  # HF -> sharded DCP for FSDP
  hf-dist convert out/checkpoint-500 out/hf-model --trust-remote-code # the config's auto_map code (trusted)
"""


HELP = "turn a ZeRO/FSDP/Trainer checkpoint into an HF folder (sharded safetensors + config + tokenizer)"
DESCRIPTION = (
    "Convert DeepSpeed ZeRO-1/2/3, FSDP2/FSDP1 DCP, FSDP full state dicts, Trainer checkpoint-N "
    "folders or HF folders into an HF folder that AutoModelForCausalLM.from_pretrained loads, streaming with "
    "bounded memory, without unpickling foreign code, written atomically."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_paths(
        parser,
        "checkpoint-N/ folder, its inner folder, or an HF folder",
        "output folder (must not exist unless --overwrite)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16", "fp32"),
        default="auto",
        help="auto = the run's training dtype, cast from fp32 master weights when present",
    )
    parser.add_argument("--max-shard-size", default="5GB", dest="max_shard_size", help="e.g. 5GB, 500MB")
    parser.add_argument(
        "--model-config", dest="model_config", help="folder with config.json (default: found near SRC)"
    )
    parser.add_argument("--tokenizer", help="folder with tokenizer files to copy (default: the config folder)")
    parser.add_argument("--tag", help="DeepSpeed tag, e.g. global_step500 (default: the 'latest' file)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--adapter", action="store_true", help="PEFT run: write the adapter folder")
    group.add_argument("--merge-adapter", action="store_true", help="PEFT run: write the full model with LoRA merged")
    parser.add_argument("--to", choices=("hf", "dcp"), default="hf", help="output format (default: hf)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists (atomically)")
    trust_help = "allow arbitrary types in .pt files; only for files you trust"
    parser.add_argument("--trust-pickles", action="store_true", help=trust_help)
    add_trust_remote_code(parser)
    parser.add_argument("--no-progress", action="store_false", dest="progress")


def run(args: argparse.Namespace) -> int:
    from hf_dist.checkpoint.conversion.convert import convert

    options = ("dtype", "max_shard_size", "model_config", "tokenizer", "tag", "adapter", "merge_adapter", "overwrite")
    flags = ("to", "trust_pickles", "progress", "trust_remote_code")
    report = convert(args.src, args.dst, **arg_kwargs(args, *options, *flags))
    print(report.summary())
    return 0
