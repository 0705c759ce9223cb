"""`hf-dist reshard`: make a Trainer checkpoint resumable on a different number of ranks."""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_dist.checkpoint.safety.paths import ConfinedFolder
from hf_dist.cli.common import add_checkpoint_paths

EPILOG = """examples:
  hf-dist reshard out/checkpoint-500                      # ZeRO: add the universal conversion in place
  hf-dist reshard out/checkpoint-500 out/ckpt-any-world   # ... into a copy, the original untouched
  hf-dist reshard out/checkpoint-500 --check 16           # only report what resuming on 16 ranks needs

then resume with "checkpoint": {"load_universal": true} in the DeepSpeed config, or call
hf_dist.checkpoint.lifecycle.reshard.prepare_resume(ckpt, training_args=args) in the training script (it does both steps).
FSDP2 (DCP) checkpoints need nothing: accelerate reshards them on load.
"""


HELP = "make a ZeRO/FSDP Trainer checkpoint resumable on a different number of GPUs"
DESCRIPTION = (
    "Convert a DeepSpeed ZeRO-1/2/3 Trainer checkpoint to DeepSpeed's universal format (fixes "
    "'The checkpoint being loaded used a DP world size of X but the current world size is Y'); FSDP2/DCP "
    "checkpoints are reported as already reshardable."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_paths(
        parser,
        "a Trainer checkpoint-N folder",
        "write a converted copy here (default: in place)",
        dst_required=False,
    )
    parser.add_argument("--check", type=int, metavar="WORLD_SIZE", help="report only; convert nothing")
    parser.add_argument("--workers", type=int, default=1, help="processes for DeepSpeed's conversion (default 1)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="redo an existing conversion / replace a DST that holds no training state (never SRC or its run folder)",
    )
    parser.add_argument(
        "--trust-pickles",
        action="store_true",
        dest="trust_pickles",
        help="skip the allowlist check DeepSpeed's loader otherwise gets; only for files you trust",
    )


def run(args: argparse.Namespace) -> int:
    from hf_dist.checkpoint.lifecycle.reshard import inspect_checkpoint, reshard

    layout = inspect_checkpoint(args.src)
    print(f"found: {layout.describe()}")
    if args.check is not None:
        print(resume_advice(layout, args.check))
        return 0
    if not layout.family.is_zero:
        print("nothing to convert: FSDP/DCP and unsharded checkpoints reshard on load")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    out = reshard(args.src, args.dst, workers=args.workers, overwrite=args.overwrite, trust_pickles=args.trust_pickles)
    if layout.family.is_zero:
        done = inspect_checkpoint(out)
        written = ConfinedFolder(Path(out))
        print(f"wrote {written.path(done.universal_tag)} and {written.path('latest_universal')}")
        print('resume with "checkpoint": {"load_universal": true} in the DeepSpeed config')
    return 0


def resume_advice(layout, world_size: int) -> str:
    """What resuming ``layout`` (a :class:`hf_dist.checkpoint.formats.contents.CheckpointContents`) on ``world_size`` needs."""
    if world_size < 1:
        raise ValueError(f"--check needs a world size >= 1, got {world_size}")
    if not layout.family.is_zero:
        return f"resumable on {world_size} rank(s) as is (reshards on load)"
    if layout.world_size == world_size:
        return f"resumable on {world_size} rank(s) as is (same DP world size)"
    if layout.universal_tag:
        return f"resumable on {world_size} rank(s) with load_universal (already converted: {layout.universal_tag})"
    return f"needs `hf-dist reshard {layout.root}` (saved by {layout.world_size} ranks, resuming on {world_size})"
