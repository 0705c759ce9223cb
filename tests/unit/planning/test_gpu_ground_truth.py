"""The memory model, the throughput model and the planner against the H100 and H200 measurements in
benchmarks/data/gpu (issue 10's targets on the H100, issue 33's on the H200).

Pure arithmetic on recorded data: no GPU is needed. ``benchmarks/gpu_ground_truth.py`` prints the table.
"""

import glob
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
FILES = sorted(glob.glob(str(ROOT / "benchmarks" / "data" / "gpu" / "*.json")))


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_ground_truth", ROOT / "benchmarks" / "gpu_ground_truth.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ground_truth_is_shipped():
    assert FILES, "benchmarks/data/gpu/*.json is missing"


def test_every_case_meets_the_memory_targets():
    bench = _bench()
    rows, failures = bench.memory_rows(bench.load(FILES))
    assert not failures
    fp32_masters = [r for r in rows if r["precision"] == "fp32 masters" and not r["oom"]]
    assert len(fp32_masters) >= 10 and all(0.95 <= r["ratio"] <= 1.15 for r in fp32_masters)
    assert all(r["predicted_gib"] > r["capacity_gib"] for r in rows if r["oom"])


def test_every_h200_run_within_issue_33s_targets():
    bench = _bench()
    cases = bench.load(FILES)
    memory = [r for r in bench.memory_rows(cases)[0] if r["gpu"] == "H200"]
    assert len(memory) == 4 and all(0.97 <= r["ratio"] <= 1.10 for r in memory), [r["ratio"] for r in memory]
    speed, failures = bench.throughput_rows(cases)
    h200 = [r for r in speed if r["gpu"] == "H200"]
    assert not failures and len(h200) == 4 and all(0.85 <= r["ratio"] <= 1.15 for r in h200)


def test_the_planners_estimate_of_every_run_is_within_a_third():
    speed, _ = _bench().throughput_rows(_bench().load(FILES))
    assert len(speed) == 19 and all(0.75 <= r["ratio"] <= 1.33 for r in speed), [round(r["ratio"], 3) for r in speed]


def test_planner_picks_run_and_are_fast():
    bench = _bench()
    lines, failures = bench.planner_rows(bench.load(FILES))
    assert not failures
    assert len(lines) >= 2 and not any("OUT OF MEMORY" in line for line in lines)


@pytest.mark.parametrize("liger", [True, False])
def test_planner_never_chooses_what_ran_out_of_memory(liger):
    import hf_dist
    from hf_dist.planning.hardware import Hardware

    bench = _bench()
    cases = bench.load(FILES)
    env, _, config_dir = cases[0]
    hw = Hardware(
        device="cuda", gpus_per_node=1, gpu_memory_gib=bench.capacity_gib(env), gpu_name="NVIDIA H100 80GB HBM3",
        bf16=True, fp16=True, liger_kernel=liger,
    )  # fmt: skip
    plan = hf_dist.plan(str(config_dir / "config.json"), hardware=hw, global_batch_size=64)
    for _, case, _ in cases:
        if case["measured"]["out_of_memory"]:
            same = (case["strategy"], case["micro_batch_size"], case["activation_checkpointing"]) == (
                plan.strategy, plan.micro_batch_size, plan.activation_checkpointing,
            )  # fmt: skip
            assert not (same and case["use_liger_kernel"] == plan.use_liger_kernel)
    assert plan.use_liger_kernel is liger
