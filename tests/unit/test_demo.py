"""`make demo`: the launch line leaves nothing to accelerate's defaults, and a run without DeepSpeed stays without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hf_dist.demo import build_command


def test_launch_passes_every_value_accelerate_would_warn_about():
    cmd = build_command(Path("recipes/sft.py"), Path("out"), steps=10, nproc=2)
    flags = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--") and cmd[i] != "--multi_gpu"}
    assert {k: flags[k] for k in ("--num_processes", "--num_machines", "--dynamo_backend", "--mixed_precision")} == {
        "--num_processes": "2",
        "--num_machines": "1",
        "--dynamo_backend": "no",
        "--mixed_precision": "no",
    }
    assert "--multi_gpu" in cmd  # without it accelerate starts one process on a machine without GPUs


def test_recipe_arguments_without_deepspeed_keep_it_unimported_and_unpinned(tmp_path):
    """What a DDP recipe run does before its Trainer: no deepspeed import, no pinned memory on CPU."""
    code = f"""
import sys
from hf_dist import recipe_utils as ru
from hf_dist.testing import tiny_llama_config
_, kwargs, explicit = ru.parse_recipe_args((ru.ModelArguments,), ["--output_dir", {str(tmp_path)!r}],
                                          embedded_defaults=dict(ru.EMBEDDED_TRAINING_DEFAULTS), real_defaults={{}})
args = ru.training_arguments(kwargs, explicit, tiny_llama_config(), method="full", seq_len=32, strategy="ddp")
from accelerate.utils import extract_model_from_parallel
import torch
extract_model_from_parallel(torch.nn.Linear(2, 2))  # what Trainer.__init__ calls via unwrap_model
print("RESULT", args.dataloader_pin_memory, "deepspeed" in sys.modules)
import deepspeed  # a DeepSpeed run later in the same process: its engines are recognised again
from accelerate.utils import other
print("RESULT", other.is_deepspeed_available())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    results = [line.split()[1:] for line in out.splitlines() if line.startswith("RESULT ")]
    assert results == [["False", "False"], ["True"]]
