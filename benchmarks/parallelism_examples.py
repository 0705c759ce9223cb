"""Worked examples of the planner beyond data parallelism (docs/parallelism.md): what it chooses, and why.

Usage:  python benchmarks/parallelism_examples.py [--full]

Each example is a public Llama 3 shape written out by hand (``hf_dist.testing.LLAMA3_SHAPES``, no hub access) planned for hardware described by
its numbers (H100 SXM GPUs: 80 GiB, 989 dense bf16 TFLOPs); ``--full`` prints every candidate's table (``Plan.explain()``). Pure arithmetic: a laptop plans
these in about a second each. The features are the newest tested versions' (accelerate >= 1.12,
deepspeed >= 0.18.2), so every dimension is available whatever is installed here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXAMPLES = (
    ("Llama-3.1-8B at 128k-token context on 8 x 80 GB", "Llama-3.1-8B",
     dict(gpus=8, gpu_memory_gib=80, seq_len=131072, global_batch_size=8)),
    ("Llama-3-70B full fine-tuning on 8 nodes x 8 x 80 GB at global batch 16", "Llama-3-70B",
     dict(gpus=64, nodes=8, gpu_memory_gib=80, seq_len=4096, global_batch_size=16)),
    ("Llama-3.1-70B at 64k-token context on 8 x 80 GB with 2 TiB of host RAM", "Llama-3.1-70B",
     dict(gpus=8, gpu_memory_gib=80, seq_len=65536, global_batch_size=8, host_memory_gib=2048)),
    ("Llama-3-70B full fine-tuning on 8 x 80 GB with 256 GiB of host RAM and NVMe (12 GB/s per node)",
     "Llama-3-70B", dict(gpus=8, gpu_memory_gib=80, seq_len=4096, global_batch_size=16, host_memory_gib=256,
                         nvme_gbps=12)),
    ("... the same with 512 GiB of host RAM", "Llama-3-70B",
     dict(gpus=8, gpu_memory_gib=80, seq_len=4096, global_batch_size=16, host_memory_gib=512, nvme_gbps=12)),
    ("Llama-3.1-405B full fine-tuning on 16 nodes x 8 x 80 GB at global batch 64", "Llama-3.1-405B",
     dict(gpus=128, nodes=16, gpu_memory_gib=80, seq_len=4096, global_batch_size=64)),
    ("Llama-3.1-405B full fine-tuning on 32 nodes x 8 x 80 GB at global batch 256", "Llama-3.1-405B",
     dict(gpus=256, nodes=32, gpu_memory_gib=80, seq_len=4096, global_batch_size=256)),
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="print every candidate (Plan.explain())")
    args = parser.parse_args()
    from hf_dist.planning.features import NEWEST_TESTED_FEATURES
    from hf_dist.planning.hardware import detect_hardware
    from hf_dist.planning.planner import PlanError, plan
    from hf_dist.testing import llama3_config

    for title, shape, kw in EXAMPLES:
        print(f"## {title}")
        start = time.perf_counter()
        try:
            hw = {k: kw.pop(k) for k in ("gpus", "nodes", "gpu_memory_gib", "host_memory_gib", "nvme_gbps") if k in kw}
            hardware = detect_hardware(gpu_name="NVIDIA H100 80GB HBM3", liger_kernel=False, **hw)
            p = plan(llama3_config(shape), hardware=hardware, features=NEWEST_TESTED_FEATURES, **kw)
        except PlanError as e:
            print(f"PlanError ({time.perf_counter() - start:.2f} s): {e}\n")
            continue
        text = p.explain()
        keep = ("chosen:", "why:", "parallelism:")
        print("\n".join(text.splitlines() if args.full else [ln for ln in text.splitlines() if ln.startswith(keep)]))
        print(f"({len(p.candidates)} candidates, {time.perf_counter() - start:.2f} s)\n")


if __name__ == "__main__":
    main()
