"""Every launch line printed in README.md and docs/ is run by a test, or says why it cannot run here.

A launch line is a command (in a code block or inline code) that starts with ``accelerate launch``, ``torchrun``,
``deepspeed --`` or ``python -m torch.distributed.run`` and has at least one flag or script; a bare tool name in
prose is not one. :data:`CATALOG` names, for each, the test that runs it (at 2 CPU ranks where the docs say 8 GPUs:
the same launcher, flags and script, fewer ranks), or the reason it cannot run on this machine. A new launch line
in the docs fails this test until it is catalogued, and a catalogued test that no longer exists fails it too.
"""

from __future__ import annotations

import re

from hf_dist.testing import REPO_ROOT

LAUNCHER = re.compile(
    r"^(\S+=\S+ )*(srun )?(accelerate launch|torchrun|deepspeed --|python -m torch\.distributed\.run)"
)

RECIPES = "tests/distributed/test_recipes.py::test_recipe_trains_under_the_requested_strategy"
CONFIGS = "tests/distributed/test_accelerate_configs.py::test_config_takes_effect"
RESTARTS = "tests/distributed/test_fault_tolerance.py::test_kill_mid_step_twice_resumes_and_matches_uninterrupted"
MULTINODE = "tests/distributed/test_multinode.py::"
PLAIN_TORCHRUN = "tests/distributed/test_launch_lines.py::test_plain_torchrun_of_a_recipe_trains_one_two_rank_job"
NO_GPU = "not run here: needs GPUs"

# doc line -> the test that runs it (scaled to 2 CPU ranks), or why it cannot run here
CATALOG: dict[str, str] = {
    "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 8 train.py": (
        f"{CONFIGS} (ddp.yaml, 2 ranks); the README's train.py: tests/unit/test_readme_snippet.py"
    ),
    "accelerate launch recipes/sft.py": "tests/distributed/test_launch_lines.py::test_accelerate_launch_of_a_recipe",
    "accelerate launch --num_processes 8 recipes/sft.py --model_name_or_path meta-llama/Llama-3.1-8B-Instruct "
    "--dataset chat.jsonl --output_dir out/sft-8b": (
        f"{RECIPES} (--multi_gpu --num_processes 2 on CPU ranks; a local model and dataset: no hub here)"
    ),
    "torchrun --nproc_per_node=8 --max-restarts=3 train.py": f"{RESTARTS} (2 ranks, --max-restarts=2)",
    "torchrun --nproc_per_node 2 train.py": PLAIN_TORCHRUN,
    "accelerate launch --config_file accelerate_configs/ddp.yaml": CONFIGS,
    "accelerate launch --multi_gpu --max_restarts K": (
        f"{NO_GPU}: on CPU ranks accelerate uses its simple launcher, which does not restart (docs/fault-tolerance.md)"
    ),
    "torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr 10.0.0.1 --master_port 29500 train.py": (
        f"{MULTINODE}test_torchrun_two_nodes_hsdp (two node ranks on loopback, 2 ranks each)"
    ),
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id job42 "
    "--max_restarts 3 train.py": "not run here: needs two hosts (the c10d rendezvous endpoint is another machine)",
    "accelerate launch --machine_rank $SLURM_NODEID": f"{MULTINODE}test_accelerate_two_nodes_hsdp_yaml",
    "accelerate launch --config_file accelerate_configs/hsdp_2node.yaml --machine_rank 0 --main_process_ip 10.0.0.1 "
    "--main_process_port 29500 recipes/sft.py --output_dir out/run1": (
        f"{MULTINODE}test_accelerate_two_nodes_hsdp_yaml (machine ranks 0 and 1 on loopback, 2 ranks each)"
    ),
    "torchrun --rdzv_backend c10d": "not run here: needs two hosts (a SLURM allocation)",
    "deepspeed --hostfile examples/hostfile --master_addr node-001 --master_port 29500 recipes/sft.py --deepspeed "
    "ds_zero3.json --output_dir out/run1": "not run here: needs ssh between hosts (pdsh fan-out)",
    "deepspeed --hostfile examples/hostfile --no_ssh --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 "
    "recipes/sft.py --deepspeed ds_zero3.json --output_dir out/run1": (
        f"{MULTINODE}test_deepspeed_hostfile_two_nodes_zero3 (node ranks 0 and 1 on loopback)"
    ),
    "accelerate launch --config_file accelerate_configs/zero3.yaml --num_machines 2 ...": (
        f"{MULTINODE}test_accelerate_two_nodes_ddp_template (the same two-machine rendezvous); zero3.yaml: {CONFIGS}"
    ),
    "torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 2 --master_addr 127.0.0.1": (
        f"{MULTINODE}test_torchrun_two_nodes_hsdp"
    ),
    "accelerate launch --config_file accelerate_configs/hsdp_2node.yaml --num_processes 4 "
    "--parallelism_config_dp_shard_size 2 --machine_rank {0,1} --main_process_ip 127.0.0.1": (
        f"{MULTINODE}test_accelerate_two_nodes_hsdp_yaml"
    ),
    "accelerate launch --config_file accelerate_configs/multi_node_template.yaml --num_processes 2 --machine_rank {0,1}": (
        f"{MULTINODE}test_accelerate_two_nodes_ddp_template"
    ),
    "deepspeed --hostfile H --no_ssh --node_rank {0,1} --master_addr 127.0.0.1": (
        f"{MULTINODE}test_deepspeed_hostfile_two_nodes_zero3"
    ),
    "accelerate launch --config_file accelerate_configs/fsdp2_tp2.yaml train.py": (
        f"{NO_GPU}: accelerate's TP needs CUDA; the same layout through TrainingArguments: "
        "tests/distributed/test_tensor_parallel.py::test_fsdp2_x_tp_uses_a_2d_mesh"
    ),
    "torchrun --nproc_per_node 4": "tests/distributed/test_tensor_parallel.py::test_fsdp2_x_tp_uses_a_2d_mesh",
    "accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train.py": (
        f"{NO_GPU}: context parallelism has no CPU attention rule (refused on CPU: "
        "tests/unit/configs/test_accelerate.py)"
    ),
    "accelerate launch --config_file accelerate_configs/zero2_sp2.yaml train.py": (
        f"{NO_GPU}: the YAML's CPU form runs as the recipe's --sp_size 2: "
        "tests/distributed/test_recipes.py::test_sp_recipe_runs_ulysses_sequence_parallel"
    ),
    "torchrun --nproc_per_node 2": "tests/distributed/test_tensor_parallel.py::test_tp2_shards_every_linear_and_the_embeddings",
    "torchrun --nproc_per_node 2 tests/distributed/scripts/load_rss.py MODEL_DIR OUT": (
        "tests/distributed/test_load_memory.py::test_an_fp32_load_of_a_16_bit_checkpoint_peaks_at_the_planned_figure"
    ),
    "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no "
    "--dynamo_backend no recipes/sft.py --tp_size 2 --model_parallel_on_cpu": (
        "tests/distributed/test_recipes.py::test_tp_recipe_runs_tensor_parallel"
    ),
    "accelerate launch --num_processes 2": (
        "tests/distributed/test_launch_lines.py::test_accelerate_launch_without_multi_gpu_stops_with_the_command"
    ),
    "torchrun --nproc_per_node 2 recipes/sft.py": PLAIN_TORCHRUN,
    "torchrun --nproc_per_node 8 --max-restarts 3 recipes/sft.py --output_dir out/sft-8b "
    "--resume_from_checkpoint auto ...": f"{RESTARTS} (torchrun --max-restarts on 2 ranks, resuming with auto_resume)",
    "accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 --main_process_ip 127.0.0.1 "
    "--main_process_port <free> --mixed_precision no tests/distributed/scripts/strategies_minimal.py "
    "--out report.json": CONFIGS,
    "HF_DIST_FSDP_ON_CPU=1 torchrun --nproc_per_node 2 my_script.py": (
        "tests/distributed/test_strategies.py::test_strategy_really_ran"
    ),
    "HF_DIST_FSDP_ON_CPU=1 ACCELERATE_USE_CPU=1 accelerate launch --config_file "
    "accelerate_configs/fsdp2_full_shard.yaml --num_processes 2 --mixed_precision no my_script.py": CONFIGS,
}


def launch_lines() -> dict[str, str]:
    """{launch line: 'file:line'} of README.md and docs/*.md; continued lines (``\\``) joined."""
    found = {}
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        in_block = False
        for i, line in enumerate(lines):
            if line.startswith("```"):
                in_block = not in_block
                continue
            texts = [line.strip().removeprefix("$ ")] if in_block else re.findall(r"`([^`]+)`", line)
            for text in texts:
                if not LAUNCHER.match(text.strip()):
                    continue
                j = i
                while in_block and text.endswith("\\") and j + 1 < len(lines):
                    j += 1
                    text = text[:-1].rstrip() + " " + lines[j].strip()
                command = text.split("  #")[0].strip()
                if len(command.split()) > 2 or "=" in command.split()[0]:  # flags or a script: a launch line
                    found.setdefault(command, f"{path.relative_to(REPO_ROOT)}:{i + 1}")
    return found


def test_every_launch_line_in_the_docs_is_catalogued():
    missing = {line: where for line, where in launch_lines().items() if line not in CATALOG}
    assert not missing, "launch lines with no test named in CATALOG:\n" + "\n".join(
        f"  {where}: {line}" for line, where in missing.items()
    )


def test_every_catalogued_test_exists_and_every_entry_is_still_in_the_docs():
    printed = launch_lines()
    assert not set(CATALOG) - set(printed), f"catalogued but no longer printed: {sorted(set(CATALOG) - set(printed))}"
    for line, entry in CATALOG.items():
        for node in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", entry):
            path, name = node
            source = (REPO_ROOT / path).read_text()
            assert not name or re.search(rf"^def {name}\(", source, re.M), f"{line!r}: {path}::{name} does not exist"


def test_cpu_launch_lines_leave_nothing_to_accelerates_defaults(monkeypatch, caplog):
    """A line printed to be run as written on CPU ranks (``ACCELERATE_USE_CPU=1 accelerate launch ...``) passes every
    value accelerate would otherwise default and list in its "values were not passed" block (the TP line printed that
    block): checked with accelerate's own validation of the line's arguments, without a user's `accelerate config`."""
    import logging
    import shlex

    from accelerate.commands import launch as accelerate_launch

    monkeypatch.setattr(accelerate_launch, "default_config_file", str(REPO_ROOT / "no-such-default-config.yaml"))
    monkeypatch.chdir(REPO_ROOT)  # a --config_file is relative to the repository
    cpu_lines = [line for line in launch_lines() if "ACCELERATE_USE_CPU=1 accelerate launch" in line]
    assert any("--tp_size 2" in line for line in cpu_lines)
    for line in cpu_lines:
        words = shlex.split(line)
        for word in words[: words.index("accelerate")]:
            monkeypatch.setenv(*word.split("=", 1))
        args = accelerate_launch.launch_command_parser().parse_args(words[words.index("launch") + 1 :])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=accelerate_launch.logger.name):
            accelerate_launch._validate_launch_command(args)
        assert "were not passed" not in caplog.text, f"{line}:\n{caplog.text}"
