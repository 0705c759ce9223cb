"""`hf-dist verify`: compare two checkpoints/folders of any supported format tensor by tensor."""

from __future__ import annotations

import argparse

from hf_dist.cli.common import add_positional, add_trust_remote_code

EPILOG = """examples:
  hf-dist verify out/checkpoint-500 out/hf-model                 # exact comparison, any two formats
  hf-dist verify out/checkpoint-500 out/hf-model --atol 1e-2     # e.g. fp32 master vs bf16 output
  hf-dist verify out/hf-model out/hf-model-2 --logits            # also compare logits on a fixed input
"""


HELP = "compare two checkpoints tensor by tensor (and optionally logits); non-zero exit on mismatch"
DESCRIPTION = (
    "Compare checkpoints A and B (DeepSpeed, DCP, FSDP full state dict, HF) after the same name "
    "mapping the converter uses: missing/extra keys, shapes, max abs diff (in fp32). Exit 1 on mismatch."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_positional(parser, "a")
    add_positional(parser, "b")
    parser.add_argument("--atol", type=float, default=0.0, help="allowed max abs difference (default 0: exact)")
    parser.add_argument("--logits", action="store_true", help="also run both models on a fixed input")
    parser.add_argument("--model-config", dest="model_config", help="config folder when A or B has none")
    parser.add_argument("--trust-pickles", action="store_true", dest="trust_pickles")
    add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> int:
    from hf_dist.checkpoint.conversion.verify import verify

    report = verify(
        args.a, args.b, logits=args.logits, atol=args.atol, model_config=args.model_config,
        trust_pickles=args.trust_pickles, trust_remote_code=args.trust_remote_code,
    )  # fmt: skip
    print(report.summary())
    return 0 if report.ok else 1
