"""What a user sees when relaunching a recipe (issue 32), on 2 CPU ranks with the embedded default, as documented:

- ``--save_steps`` alone saves on the embedded default (which otherwise saves only at the end);
- the rerun of a finished run trains nothing and says so in one line; a killed run's rerun resumes and finishes;
- every refusal of the arguments is printed once (by rank 0) before any model is built, with no traceback from the
  ranks and exit status 2 on every rank (accelerate's launcher then reports the failed ranks in its own block).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from hf_dist.testing import GLOO_ABORT, REPO_ROOT, cpu_env, free_port

pytestmark = pytest.mark.distributed

RECIPE = REPO_ROOT / "recipes" / "sft.py"
TINY = ["--tiny_hidden_size", "64", "--num_train_examples", "64", "--num_eval_examples", "8", "--logging_steps", "1"]
RUN = ["--max_steps", "4", "--save_steps", "2", *TINY]
MODEL_BUILT = ("[hf_dist] plan:", "task accuracy before training")  # printed once the model exists
FINISHED = "[hf_dist] nothing to train: checkpoint-4 is at step 4 and max_steps is 4, so this run is finished"


def launch(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """``accelerate launch`` of recipes/sft.py on 2 CPU ranks, as the docs print it: (exit status, all output). A
    launch whose rank died of gloo's rare abort is launched once more."""
    for _ in range(2):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(RECIPE), *map(str, args)]  # fmt: skip
        proc = subprocess.run(cmd, env=cpu_env(env), capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        if GLOO_ABORT not in out:
            break
    return proc.returncode, out


def rank_tracebacks(out: str) -> int:
    """Tracebacks the ranks printed: every one but the launcher's own report that they exited non-zero."""
    launcher = out.count("elastic.multiprocessing.errors.ChildFailedError")
    return out.count("Traceback (most recent call last)") - launcher


def test_save_steps_alone_saves_a_finished_rerun_trains_nothing_and_a_killed_run_resumes(tmp_path):
    out = tmp_path / "sft"
    rc, log = launch(["--output_dir", out, *RUN])
    assert rc == 0, log[-4000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]  # --save_steps 2
    results = (out / "results.json").read_text()

    rc, log = launch(["--output_dir", out, *RUN, "--resume_from_checkpoint", "auto"])  # the same line, rerun
    assert rc == 0, log[-4000:]
    assert log.count("[hf_dist] nothing to train") == 1 and FINISHED in log, log[-4000:]
    assert not any(marker in log for marker in MODEL_BUILT) and "resuming from" not in log
    assert not (out / "checkpoint-5").exists() and (out / "results.json").read_text() == results

    # killed after step 2's save: the rerun resumes there and finishes the run
    for name in ("checkpoint-4", "final", "results.json"):
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    rc, log = launch(["--output_dir", out, *RUN, "--resume_from_checkpoint", "auto"])
    assert rc == 0, log[-4000:]
    assert log.count(f"[hf_dist] resuming from {out / 'checkpoint-2'}") == 1, log[-4000:]
    assert json.loads((out / "results.json").read_text())["steps"] == 4 and not (out / "checkpoint-5").exists()


# One refusal of each kind, launched (each launch ~15 s of imports on 2 cores); every refusal the recipes make, in
# process and before any model is built: tests/unit/test_recipe_refusals.py. refusal: (flags, environment, set-up,
# its first line)
REFUSALS = {
    # the output folder's state: transformers' raw FileExistsError from each rank after the model was built
    "output dir is a file": ([], {}, lambda tmp: (tmp / "out").write_text("x"), "--output_dir {out} is a file"),
    # a hub name without a hub: a minute of retries, 78 lines and 2 tracebacks
    "hub unreachable": (["--model_name_or_path", "meta-llama/Llama-3.2-1B"],
                        {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, None,
                        "could not resolve model 'meta-llama/Llama-3.2-1B': it is not a local folder or file"),
    # a contradiction the plan finds (auto_args): torch's `view size is not compatible` from each rank after 72 s
    "sp micro-batch on cpu ranks": (["--strategy", "zero2", "--sp_size", "2", "--deepspeed_on_cpu",
                                     "--model_parallel_on_cpu", "--per_device_train_batch_size", "16"],
                                    {"ACCELERATE_USE_CPU": "false"}, None,
                                    "micro_batch_size 16 (per_device_train_batch_size) cannot run: Ulysses sequence "
                                    "parallelism (sp=2) runs on CPU ranks at micro-batch 1 only"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refusal_is_printed_once_before_any_model_is_built(name, tmp_path):
    flags, env, set_up, first = REFUSALS[name]
    if set_up:
        set_up(tmp_path)
    out = tmp_path / "out"
    rc, log = launch(["--output_dir", out, *flags, *RUN], env)
    line = "[hf_dist] refused: " + first.format(out=out)
    assert rc != 0 and log.count(line) == 1, log[-4000:]
    # the refusal's status; a rank still exiting when the other's status reached the launcher is stopped by it
    assert "exitcode  : 2" in log and set(re.findall(r"exitcode  : (-?\d+)", log)) <= {"2", "-15"}, log[-4000:]
    assert rank_tracebacks(log) == 0, log[-4000:]
    assert not any(marker in log for marker in MODEL_BUILT), log[-4000:]
    assert "Retrying in" not in log  # huggingface_hub's retries: a minute from every rank before
