"""`hf-dist bench`: throughput of each feasible strategy at 1 and N processes, and scaling efficiency."""

from __future__ import annotations

import argparse
import dataclasses

from hf_dist.cli.common import add_trust_remote_code

EPILOG = """examples:
  hf-dist bench --nproc 8 --model meta-llama/Llama-3.1-8B --seq-len 2048 --micro-batch-size 1
  hf-dist bench --nproc 8 --model ./my-model --strategies fsdp_full_shard,zero3 --autotune best.yaml
  hf-dist bench --nproc 2 --steps 5 --json bench.json          # tiny Llama on CPU: checks the setup

Every (strategy, process count) runs in fresh processes launched by torchrun, with randomly initialised
weights (only the model's config is read). Throughput is measured after --warmup steps.
"""


HELP = "measure samples/s, tokens/s and scaling efficiency of each feasible strategy"
DESCRIPTION = (
    "Run a few training steps of each strategy the planner finds feasible at 1 and N processes; "
    "print samples/s, tokens/s and scaling efficiency throughput_N / (N x throughput_1); report where the "
    "planner's pick is not the fastest measured; --autotune writes the fastest one's accelerate config."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="N, processes of the scaled run (default 2)")
    parser.add_argument("--model", help="model folder, config.json or hub name (default: a tiny Llama)")
    parser.add_argument("--strategies", help="comma-separated subset, e.g. ddp,fsdp_full_shard,zero3")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=4, dest="micro_batch_size")
    parser.add_argument("--seq-len", type=int, default=64, dest="seq_len")
    parser.add_argument(
        "--mixed-precision", default="auto", choices=("auto", "bf16", "fp16", "no"), dest="mixed_precision"
    )
    parser.add_argument("--gpu-memory", type=float, dest="gpu_memory_gib", help="GiB per GPU for the planner")
    parser.add_argument(
        "--timeout", type=float, default=600.0, dest="timeout_s", help="seconds per launch (default 600)"
    )
    parser.add_argument("--autotune", metavar="YAML", help="write the fastest strategy's accelerate config here")
    parser.add_argument("--force", action="store_true", help="overwrite the --autotune file")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    add_trust_remote_code(parser)


def run(args: argparse.Namespace) -> int:
    from hf_dist.bench import BenchConfig, run_bench, write_autotune

    # every BenchConfig field is a flag of the same dest; --strategies is a comma-separated list
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)}
    values["strategies"] = tuple(s.strip() for s in (args.strategies or "").split(",") if s.strip()) or None
    config = BenchConfig(**values)
    report = run_bench(config)
    print(report.format())
    if args.json:
        from hf_dist.atomic_io import atomic_write_json

        atomic_write_json(args.json, report.to_dict())
    if args.autotune:
        path = write_autotune(report, args.autotune, force=args.force)
        print(f"wrote {path} ({report.fastest().strategy})")
    return 0 if report.fastest() is not None else 1
