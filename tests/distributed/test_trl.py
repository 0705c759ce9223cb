"""TRL's SFTTrainer on 2 CPU ranks with hf_dist.auto_args(config_class=SFTConfig) and attach(trainer, plan=plan): what
ran is what was planned (wrapped type, checkpointing, precision, micro-batch x accumulation x world), although
SFTConfig's own defaults say gradient_checkpointing=True and bf16 by device."""

from __future__ import annotations

import json

import pytest

from hf_dist.testing import REPO_ROOT, torchrun

pytest.importorskip("trl", reason="the trl extra (hf_dist[trl]) is not installed in this environment")
pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests/distributed/scripts/trl_sft_train.py"
# DDP: plain torchrun without ACCELERATE_USE_CPU, so only auto_args' use_cpu joins the ranks; FSDP2 on CPU ranks is
# hf_dist's test opt-in (hf_dist/runtime/cpu_fsdp.py)
LAUNCHES = {
    "ddp": ({"ACCELERATE_USE_CPU": "0"}, "DistributedDataParallel"),
    "fsdp_full_shard": ({"HF_DIST_FSDP_ON_CPU": "1"}, "FSDPLlamaForCausalLM"),
}


@pytest.mark.parametrize("strategy", list(LAUNCHES))
def test_sft_trainer_runs_the_plan(strategy, tmp_path):
    env, wrapped = LAUNCHES[strategy]
    out, run = tmp_path / "report.json", tmp_path / "run"
    args = ["--strategy", strategy, "--out", out, "--output-dir", run]
    torchrun(SCRIPT, args, env=env, timeout=300, outputs=[out, run])
    report = json.loads(out.read_text())
    assert report["mismatches"] == [] and report["steps"] == 3  # PlanCallback(strict) let it train: no difference
    assert (report["world_size"], report["strategy"], report["wrapped"]) == (2, strategy, wrapped)
    assert report["checkpointing"] is False and report["bf16"] is False  # SFTConfig's defaults did not win
    assert report["planned"] == [strategy, 2, *report["batch"]]  # micro-batch x accumulation as planned
    assert report["losses"][-1] < report["losses"][0]
