"""`hf-dist bench` end to end on CPU: a tiny Llama, DDP and FSDP2 at 1 and 2 processes, --autotune, --json."""

from __future__ import annotations

import json

import pytest
import yaml

from hf_dist.cli.main import main

pytestmark = pytest.mark.distributed


def test_bench_cli_measures_and_autotunes(tmp_path, capsys):
    best, report_path = tmp_path / "best.yaml", tmp_path / "bench.json"
    argv = ["bench", "--nproc", "2", "--strategies", "ddp,fsdp_full_shard", "--steps", "2", "--warmup", "1",
            "--seq-len", "32", "--autotune", str(best), "--json", str(report_path), "--timeout", "240"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())

    runs = {(m["strategy"], m["nproc"]): m for m in report["measurements"]}
    assert set(runs) == {("ddp", 1), ("ddp", 2), ("fsdp_full_shard", 1), ("fsdp_full_shard", 2)}
    for m in runs.values():
        assert m["error"] is None, m
        assert m["samples_per_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 32)
    assert runs[("fsdp_full_shard", 2)]["wrapped"].startswith("FSDP")  # FSDP2 really ran
    assert runs[("ddp", 2)]["wrapped"] == "DistributedDataParallel"
    for strategy in ("ddp", "fsdp_full_shard"):
        expected = runs[(strategy, 2)]["samples_per_s"] / (2 * runs[(strategy, 1)]["samples_per_s"])
        assert report["efficiency"][strategy] == pytest.approx(expected)
    assert report["planner_pick"] == "ddp"
    fastest = max(("ddp", "fsdp_full_shard"), key=lambda s: runs[(s, 2)]["samples_per_s"])
    assert report["fastest"] == fastest
    assert ("is the fastest measured" in out) == (fastest == "ddp")
    written = yaml.safe_load(best.read_text())
    assert written["distributed_type"] == ("MULTI_GPU" if fastest == "ddp" else "FSDP")
    assert written["num_processes"] == 2


def test_cpu_throughput_benchmark_runs_as_documented():
    """docs/measurements.md's `python benchmarks/cpu_throughput.py`, with fewer steps: the probe's rate and, for 1 and 2
    ranks, the estimate, the measurement and their ratio (the figures are the docs'; timings are not asserted)."""
    import re
    import subprocess
    import sys

    from hf_dist.testing import REPO_ROOT

    assert "`python benchmarks/cpu_throughput.py`" in (REPO_ROOT / "docs" / "measurements.md").read_text()
    cmd = [sys.executable, "benchmarks/cpu_throughput.py", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"per-core fp32 matmul rate \(planner's probe\): [0-9.]+ GFLOP/s", proc.stdout)
    rows = re.findall(r"^\s+([12])\s+([0-9,]+)\s+([0-9,]+)\s+([0-9.]+)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["1", "2"], proc.stdout
    assert all(float(r[3]) > 0 for r in rows)
