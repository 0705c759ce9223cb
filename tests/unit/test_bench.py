"""hf_dist.bench report logic, planning and --autotune on synthetic measurements (real runs: tests/distributed)."""

from __future__ import annotations

import pytest
import yaml

from hf_dist.bench import BenchConfig, BenchReport, Measurement, _planned_strategies, write_autotune
from hf_dist.cli.main import main


def report(pick: str | None = "ddp") -> BenchReport:
    r = BenchReport(BenchConfig(nproc=4), "cpu", planner_pick=pick)
    r.measurements = [
        Measurement("ddp", 1, 10.0, 640.0, 0.4),
        Measurement("ddp", 4, 30.0, 1920.0, 0.53),
        Measurement("zero3", 1, 8.0, 512.0, 0.5),
        Measurement("zero3", 4, 36.0, 2304.0, 0.44),
        Measurement("fsdp_full_shard", 1, 9.0, 576.0, 0.44),
        Measurement("fsdp_full_shard", 4, error="RuntimeError: boom"),
    ]
    return r


def test_efficiency_and_fastest():
    r = report()
    assert r.efficiency("ddp") == pytest.approx(30 / (4 * 10))
    assert r.efficiency("zero3") == pytest.approx(36 / (4 * 8))
    assert r.efficiency("fsdp_full_shard") is None  # the N-process run failed
    assert r.fastest().strategy == "zero3"
    assert r.fastest(1).strategy == "ddp"


def test_notes_say_when_the_pick_is_not_fastest():
    assert r_notes("ddp") == ["planner's pick ddp is not the fastest measured: zero3 is 20% faster "
                              "(36.0 vs 30.0 samples/s); --autotune writes zero3"]  # fmt: skip
    assert r_notes("zero3") == ["planner's pick zero3 is the fastest measured"]
    assert "failed" in r_notes("fsdp_full_shard")[0]


def r_notes(pick: str) -> list[str]:
    return report(pick).notes()


def test_format_table():
    text = report().format()
    assert "75%" in text and "112%" in text  # ddp and zero3 scaling at 4 processes
    assert "failed: RuntimeError: boom" in text
    assert "*" in next(line for line in text.splitlines() if line.startswith("ddp") and " 4 " in line)
    assert report().to_dict()["fastest"] == "zero3"


def test_config_validation():
    with pytest.raises(ValueError, match="nproc must be >= 2"):
        BenchConfig(nproc=1)
    with pytest.raises(ValueError, match=r"cannot benchmark strategies \['hsdp'\]"):
        BenchConfig(strategies=("hsdp",))
    with pytest.raises(ValueError, match="mixed_precision 'fp8'"):
        BenchConfig(mixed_precision="fp8")


def test_planned_strategies_follow_the_planner():
    pick, _, strategies = _planned_strategies(BenchConfig(nproc=2, seq_len=32), "cpu")
    assert pick == strategies[0] == "ddp"
    assert set(strategies) == {"ddp", "zero1", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op"}
    _, _, chosen = _planned_strategies(BenchConfig(nproc=2, strategies=("zero3", "ddp")), "cpu")
    assert chosen == ["zero3", "ddp"]


def test_autotune_writes_fastest_accelerate_config(tmp_path):
    path = write_autotune(report(), tmp_path / "best.yaml")
    text = path.read_text()
    cfg = yaml.safe_load(text)
    assert cfg["distributed_type"] == "DEEPSPEED" and cfg["deepspeed_config"]["zero_stage"] == 3
    assert cfg["num_processes"] == 4 and cfg["mixed_precision"] == "no"
    assert text.startswith("# best.yaml: fastest strategy measured by `hf-dist bench --autotune`: zero3")
    with pytest.raises(FileExistsError):
        write_autotune(report(), path)
    empty = BenchReport(BenchConfig(), "cpu")
    with pytest.raises(RuntimeError, match="no strategy ran"):
        write_autotune(empty, tmp_path / "x.yaml")


def test_cli_rejects_bad_input(capsys):
    assert main(["bench", "--nproc", "1"]) == 1
    assert "nproc must be >= 2" in capsys.readouterr().err


def test_failed_launch_reports_the_root_cause_not_torchruns_summary():
    from hf_dist.bench import _last_error

    log = """[rank1]: Traceback (most recent call last):
[rank1]:   File "x.py", line 3, in <module>
[rank1]: RuntimeError: Connection reset by peer
E1122 torch/distributed/elastic/multiprocessing/api.py] failed (exitcode: 1) local_rank: 1
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
error_file: <N/A>
traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""
    assert _last_error(log.replace("[rank1]: ", "")) == "RuntimeError: Connection reset by peer"
    assert _last_error("") == "no output"
    assert _last_error("something else went wrong: out of memory\nerror_file: <N/A>") == (
        "something else went wrong: out of memory"
    )


def test_a_cpu_measurement_whose_rank_died_of_gloos_abort_is_launched_once_more(monkeypatch):
    from hf_dist import bench
    from hf_dist.runtime.launch import GLOO_ABORT

    results = [
        bench.Measurement("ddp", 2, error=f"{GLOO_ABORT} (gloo's rare abort of a rank)"),
        bench.Measurement("ddp", 2, samples_per_s=3.0),
    ]
    monkeypatch.setattr(bench, "_measure_once", lambda *a: results.pop(0))
    assert bench.measure(None, "ddp", 2, "cpu").samples_per_s == 3.0
    results[:] = [bench.Measurement("ddp", 2, error="RuntimeError: boom"), bench.Measurement("ddp", 2)]
    assert bench.measure(None, "ddp", 2, "cpu").error == "RuntimeError: boom"  # any other failure stands
