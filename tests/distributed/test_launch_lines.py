"""The launch lines a new user types on a machine without GPUs, as written (no ACCELERATE_USE_CPU): plain torchrun
of a recipe trains one 2-rank job (auto_args sets use_cpu), and `accelerate launch --num_processes 2` without
--multi_gpu, which starts one process, stops with the command to run instead of training alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_dist.testing import REPO_ROOT, cpu_env, free_port, torchrun

pytestmark = pytest.mark.distributed

RECIPE = REPO_ROOT / "recipes" / "sft.py"
SHORT = ["--max_steps", "2", "--tiny_hidden_size", "64", "--num_train_examples", "64", "--num_eval_examples", "8"]
PLAIN = {"ACCELERATE_USE_CPU": "0"}  # what a user's shell has: nothing


def test_plain_torchrun_of_a_recipe_trains_one_two_rank_job(tmp_path):
    out = tmp_path / "sft"
    torchrun(RECIPE, ["--output_dir", out, *SHORT], env=PLAIN, timeout=300, outputs=[out])
    results = json.loads((out / "results.json").read_text())
    assert (results["world_size"], results["strategy"]) == (2, "ddp")


def test_accelerate_launch_without_multi_gpu_stops_with_the_command(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--main_process_port",
           str(free_port()), str(RECIPE), "--output_dir", str(tmp_path / "sft"), *SHORT]  # fmt: skip
    proc = subprocess.run(cmd, env=cpu_env(PLAIN), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "asked for --num_processes 2 but started this one process" in proc.stderr
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in proc.stderr
    assert not (tmp_path / "sft" / "results.json").exists()


def test_accelerate_launch_of_a_recipe(tmp_path):
    """The README's `accelerate launch recipes/sft.py`: one process, the embedded model, offline."""
    out = tmp_path / "sft"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), str(RECIPE),
           "--output_dir", str(out), *SHORT]  # fmt: skip
    proc = subprocess.run(cmd, env=cpu_env(PLAIN), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (results["world_size"], results["strategy"]) == (1, "ddp")
