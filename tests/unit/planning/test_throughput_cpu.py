"""The planner's tokens/s on CPU ranks against the run recorded in docs/measurements.md.

The estimate starts from a CPU rank's measured dense peak (hardware.cpu_core_gflops times the cores the rank gets) and
the GPUs' GEMM efficiency; nothing is fitted to the recorded run. It used a fixed 1 TFLOP/s per CPU rank and said
~225,000 tokens/s for the demo's 2 ranks.
"""

from __future__ import annotations

import os

import pytest

from hf_dist.planning import hardware
from hf_dist.planning.hardware import Hardware, detect_hardware
from hf_dist.planning.planner import plan
from hf_dist.testing import REPO_ROOT

# `python benchmarks/cpu_throughput.py`, recorded in docs/planner.md: the probe's per-core rate (GFLOP/s) and DDP
# tokens/s measured at 1 and 2 ranks (one thread each) for the demo's model, micro-batch 16 x 64 tokens
RECORDED_CORE_GFLOPS = 89.3
RECORDED_TOKENS_PER_S = {1: 24_646, 2: 40_714}


def demo_config():
    from hf_dist.recipe_utils.flags import ModelArguments
    from hf_dist.recipe_utils.model import load_tokenizer, model_config

    model_args = ModelArguments()
    return model_config(model_args, load_tokenizer(model_args, chat=True))


def estimate(ranks: int, core_gflops: float) -> float:
    hw = Hardware(device="cpu", gpus_per_node=ranks, gpu_memory_gib=8.0, peak_tflops=core_gflops / 1e3)
    result = plan(demo_config(), hardware=hw, seq_len=64, micro_batch_size=16, global_batch_size=16 * ranks,
                  strategy="ddp")  # fmt: skip
    return result.tokens_per_s


@pytest.mark.parametrize("ranks", [1, 2])
def test_cpu_estimate_is_within_2x_of_the_recorded_run(ranks):
    ratio = estimate(ranks, RECORDED_CORE_GFLOPS) / RECORDED_TOKENS_PER_S[ranks]
    assert 0.5 <= ratio <= 2.0, f"{ranks} rank(s): estimated / measured = {ratio:.2f}"


def test_the_recorded_figures_are_the_docs():
    text = (REPO_ROOT / "docs" / "measurements.md").read_text()
    assert "python benchmarks/cpu_throughput.py" in text and f"{RECORDED_CORE_GFLOPS} GFLOP/s" in text
    assert all(f"{tokens:,}" in text for tokens in RECORDED_TOKENS_PER_S.values())


def test_detection_gives_each_cpu_rank_its_cores_measured_rate(monkeypatch):
    for key in ("NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(hardware, "cpu_core_gflops", lambda: 80.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert detect_hardware(gpus=2).peak_tflops == pytest.approx(0.32)  # 8 cores, 4 per rank
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun and hf_dist's CPU launches set for several ranks
    assert detect_hardware(gpus=2).peak_tflops == pytest.approx(0.08)
    assert detect_hardware(gpus=16).peak_tflops == pytest.approx(0.08)  # more ranks than cores: one core each
    assert detect_hardware(gpus=8, gpu_memory_gib=80, gpu_name="NVIDIA H100 80GB HBM3").peak_tflops == 989.0


def test_the_probe_measures_a_cores_rate():
    rate = hardware.cpu_core_gflops()
    assert 1 < rate < 1000, rate  # more than any core's scalar rate, less than any core's vector fp32 peak
    assert hardware.cpu_core_gflops() == rate  # measured once per process
