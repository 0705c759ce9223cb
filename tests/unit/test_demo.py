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
from hf_dist import PlanRequest, recipe_utils as ru
from hf_dist.testing import tiny_llama_config
_, kwargs, explicit = ru.parse_recipe_args((ru.ModelArguments,), ["--output_dir", {str(tmp_path)!r}],
                                          embedded_defaults=dict(ru.EMBEDDED_TRAINING_DEFAULTS), real_defaults={{}})
args = ru.training_arguments(kwargs, explicit, tiny_llama_config(), PlanRequest(method="full", seq_len=32, strategy="ddp"))
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


def test_the_sample_shown_after_the_accuracy_is_one_it_got_right(monkeypatch):
    """The demo's one sample is the first held-out prompt answered right (it was always task[0], a miss at 99 %);
    only when none is right is a miss shown, and it says so."""
    import hf_dist.embedded.task_eval as task_eval
    from hf_dist import recipe_utils as ru
    from hf_dist.embedded.task import make_examples
    from hf_dist.recipe_utils.export import task_results

    task = make_examples(4, seed=0)
    answers = ["zz", task[1].answer + "\nmore", task[2].answer, "zz"]  # task[0] missed, as in the demo
    monkeypatch.setattr(task_eval, "answer_all", lambda model, tokenizer, examples, mode: answers)
    results = task_results(None, None, task, mode="text")
    assert results["accuracy_after"] == 0.5 and results["sample_right"]
    assert results["sample_prompt"] == task[1].text_prompt() and results["sample_expected"] == task[1].answer
    base = {"strategy": "ddp", "wrapped_model": "DDP", "steps": 1, "world_size": 2, "train_losses": [1.0],
            "eval_loss": 1.0, "perplexity": 2.7, "export_dir": "out", "exported_with": "save_model", "accuracy_before": 0.0}  # fmt: skip
    assert ru.format_results({**base, **results}).endswith(" (right)")
    answers[1:3] = ["zz", "zz"]
    missed = task_results(None, None, task, mode="text")
    assert not missed["sample_right"] and missed["sample_prompt"] == task[0].text_prompt()
    text = ru.format_results({**base, **missed})
    assert text.endswith(f"(a miss: expected {task[0].answer!r}; no held-out prompt was answered right)")
