"""`hf-dist bench`: throughput of each feasible strategy at 1 and N processes, and scaling efficiency."""

from __future__ import annotations

import argparse
import json

EPILOG = """examples:
  hf-dist bench --nproc 8 --model meta-llama/Llama-3.1-8B --seq-len 2048 --micro-batch-size 1
  hf-dist bench --nproc 8 --model ./my-model --strategies fsdp_full_shard,zero3 --autotune best.yaml
  hf-dist bench --nproc 2 --steps 5 --json bench.json          # tiny Llama on CPU: checks the setup

Every (strategy, process count) runs in fresh processes launched by torchrun, with randomly initialised
weights (only the model's config is read). Throughput is measured after --warmup steps.
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="measure samples/s, tokens/s and scaling efficiency of each feasible strategy",
        description="Run a few training steps of each strategy the planner finds feasible at 1 and N processes; "
        "print samples/s, tokens/s and scaling efficiency throughput_N / (N x throughput_1); report where the "
        "planner's pick is not the fastest measured; --autotune writes the fastest one's accelerate config.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc", type=int, default=2, help="N, processes of the scaled run (default 2)")
    parser.add_argument("--model", help="model folder, config.json or hub name (default: a tiny Llama)")
    parser.add_argument("--strategies", help="comma-separated subset, e.g. ddp,fsdp_full_shard,zero3")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=4, dest="micro_batch_size")
    parser.add_argument("--seq-len", type=int, default=64, dest="seq_len")
    parser.add_argument("--mixed-precision", default="auto", choices=("auto", "bf16", "fp16", "no"), dest="precision")
    parser.add_argument("--gpu-memory", type=float, dest="gpu_memory", help="GiB per GPU for the planner")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default 600)")
    parser.add_argument("--autotune", metavar="YAML", help="write the fastest strategy's accelerate config here")
    parser.add_argument("--force", action="store_true", help="overwrite the --autotune file")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from hf_dist.bench import BenchConfig, run_bench, write_autotune

    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip()) if args.strategies else None
    config = BenchConfig(
        nproc=args.nproc,
        model=args.model,
        strategies=strategies,
        steps=args.steps,
        warmup=args.warmup,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        mixed_precision=args.precision,
        gpu_memory_gib=args.gpu_memory,
        timeout_s=args.timeout,
    )
    report = run_bench(config)
    print(report.format())
    if args.json:
        from hf_dist.configs.accelerate import atomic_write_text

        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=2) + "\n", force=True)
    if args.autotune:
        path = write_autotune(report, args.autotune, force=args.force)
        print(f"wrote {path} ({report.fastest().strategy})")
    return 0 if report.fastest() is not None else 1
