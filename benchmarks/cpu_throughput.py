"""The planner's tokens/s on CPU ranks against training measured there, for the model `make demo` trains.

    python benchmarks/cpu_throughput.py

The model is recipes/sft.py's embedded default (a tiny Llama: hidden 128, 2 layers, the character tokenizer's
vocabulary). For 1 and 2 CPU ranks it prints: the per-core fp32 matmul rate the planner measured here
(``hf_dist.planning.hardware.cpu_core_gflops``), the planner's estimate for DDP at the demo's micro-batch 16 x 64 tokens,
and what ``hf-dist bench``'s launcher measures for the same (torchrun, the Trainer, one thread per rank as the demo
runs, full-length random sequences, timed after warm-up steps; the fastest of ``--repeats`` launches, the one least
slowed by other work on a shared machine). docs/measurements.md ("Throughput on CPU ranks") records a run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

# the ranks' environment (hf_dist.runtime.launch.cpu_env): one thread each; the planner reads it too
os.environ["OMP_NUM_THREADS"] = "1"

from hf_dist.bench import BenchConfig, measure  # noqa: E402
from hf_dist.planning.hardware import cpu_core_gflops, detect_hardware  # noqa: E402
from hf_dist.planning.planner import plan  # noqa: E402

MICRO_BATCH, SEQ_LEN = 16, 64  # the demo's: EMBEDDED_TRAINING_DEFAULTS and the embedded sequence length


def demo_config():
    """The embedded default's model config, built as recipes/sft.py builds it."""
    from hf_dist.recipe_utils.flags import ModelArguments
    from hf_dist.recipe_utils.model import load_tokenizer, model_config

    model_args = ModelArguments()
    return model_config(model_args, load_tokenizer(model_args, chat=True))


def estimate(config, ranks: int) -> float:
    hardware = detect_hardware(gpus=ranks)
    result = plan(config, hardware=hardware, seq_len=SEQ_LEN, micro_batch_size=MICRO_BATCH,
                  global_batch_size=MICRO_BATCH * ranks, strategy="ddp")  # fmt: skip
    return result.tokens_per_s


def measured(model_dir: Path, ranks: int, steps: int, warmup: int, repeats: int) -> float:
    bench = BenchConfig(nproc=2, model=str(model_dir), strategies=("ddp",), steps=steps, warmup=warmup,
                        micro_batch_size=MICRO_BATCH, seq_len=SEQ_LEN)  # fmt: skip
    runs = [measure(bench, "ddp", ranks, "cpu") for _ in range(repeats)]
    failed = [run.error for run in runs if run.error]
    if failed:
        raise SystemExit(f"cpu_throughput: a {ranks}-rank launch failed: {failed[0]}")
    return max(run.tokens_per_s for run in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per launch (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="launches per rank count; the fastest counts")
    args = parser.parse_args(argv)
    config = demo_config()
    print(f"per-core fp32 matmul rate (planner's probe): {cpu_core_gflops():.1f} GFLOP/s")
    print(f"{'ranks':>5} {'estimated tokens/s':>19} {'measured tokens/s':>18} {'estimated / measured':>21}")
    with tempfile.TemporaryDirectory(prefix="hf-dist-cpu-throughput-") as tmp:
        config.save_pretrained(tmp)
        for ranks in (1, 2):
            est, got = estimate(config, ranks), measured(Path(tmp), ranks, args.steps, args.warmup, args.repeats)
            print(f"{ranks:>5} {est:>19,.0f} {got:>18,.0f} {est / got:>21.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
