"""Every command line of README.md and docs/ (tests/doc_commands.py), keyed by its doc text, and how a test runs it.

* :class:`Run` — ``hf-dist`` and ``python -c`` lines, run in-process from the doc text by
  tests/unit/test_doc_commands.py (seconds each).
* :class:`Launch` — launcher, recipe and script lines, run as a subprocess from the doc text by
  tests/distributed/test_doc_commands.py.
* :class:`RanBy` — a named existing test runs the same command (running it twice would waste CI minutes).
* :class:`CannotRun` — why it cannot run here; a benchmark names the text its doc copied from a run of it.

Both run kinds change the doc text only through tests/doc_runs.py's ``SUBSTITUTIONS``, start in a fresh folder
standing for the repository root, with the files the doc assumes written by ``setup`` (tests/doc_setups.py) and the
doc lines of ``after`` run there first, append the declared ``extra`` arguments, and assert ``checks``
(tests/doc_checks.py): the outcome the doc states. A doc line missing here, or an entry whose line is no longer in the
docs, fails tests/unit/test_doc_commands.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.doc_checks import (
    AdapterFolder,
    ConfigWritten,
    CopiedOutput,
    DcpFolder,
    Exits,
    HfFolder,
    Plan,
    Recipe,
    Refusal,
    Restarts,
    Unchanged,
    Verified,
)
from tests.doc_setups import ChatData, LoraCheckpoint, ModelConfig, TinyModel, ZeroCheckpoint


@dataclass(frozen=True)
class Run:
    """Run in-process by tests/unit/test_doc_commands.py."""

    checks: tuple[Any, ...]
    setup: tuple[Any, ...] = ()
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class Launch:
    """Run as a subprocess by tests/distributed/test_doc_commands.py; ``env`` is what a plain shell has set."""

    checks: tuple[Any, ...]
    setup: tuple[Any, ...] = ()
    after: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    runs: tuple[tuple[str, ...], ...] = ((),)  # the line runs once per item, that item appended to ``extra``


@dataclass(frozen=True)
class RanBy:
    """``test``: a test id (``tests/...py::test_name``, which must exist) or ``.ci/run`` (which must run the line).
    Ran by tests/distributed/test_doc_commands.py's run of another doc line: ``note`` starts with that line in
    backticks (a ``Launch`` entry)."""

    test: str
    note: str = ""


@dataclass(frozen=True)
class CannotRun:
    """``reason``: what it needs that no test has. ``output``: for a benchmark, (doc file, text of that file copied
    from a run of the line) — the text must be there."""

    reason: str
    output: tuple[str, str] | None = None


Entry = Run | Launch | RanBy | CannotRun

CI = ".ci/run"
SUITE = RanBy(CI, "`make test` runs every file under tests/ (each path named must exist)")
# recipe lines on CPU: the embedded default or a tiny model, 2 steps (declared extra flags)
SHORT = ("--max_steps", "2", "--tiny_hidden_size", "64", "--num_train_examples", "64", "--num_eval_examples", "8")
PLAIN = (("ACCELERATE_USE_CPU", "0"),)  # what a new user's shell has: no CPU opt-in
OUT_CKPT = ZeroCheckpoint("out/checkpoint-500")
CONVERT = "hf-dist convert out/checkpoint-500 out/hf-model"
SFT_8B = (
    "accelerate launch --num_processes 8 recipes/sft.py --model_name_or_path meta-llama/Llama-3.1-8B-Instruct "
    "--dataset chat.jsonl --output_dir out/sft-8b"
)

DEMO_SAYS = (
    "[hf_dist] plan: chosen: ddp",
    "[hf_dist] strategy run: ddp (DistributedDataParallel), 2 steps on 2 process(es)",
    "[hf_dist] task exact-match accuracy: 0% before",
    "reloaded with from_pretrained",
    "[hf_dist] sample: ",
)
CONFIGS = "tests/distributed/test_accelerate_configs.py::test_config_takes_effect"
RECIPES = "tests/distributed/test_recipes.py::test_recipe_trains_under_the_requested_strategy"
RESTARTS = "tests/distributed/test_fault_tolerance.py::test_kill_mid_step_twice_resumes_and_matches_uninterrupted"
MULTINODE = "tests/distributed/test_multinode.py::"
SLURM_SCRIPTS = "tests/distributed/test_slurm_scripts.py::"
PLAN_FLAGS = "tests/unit/test_cli_plan.py::test_plan_has_a_flag_for_every_pin_auto_args_accepts"
DOC_LAUNCH = "tests/distributed/test_doc_commands.py::test_doc_launch_line"
NO_GPU = "needs GPUs"
TWO_HOSTS = "needs two hosts"
SLURM = "needs a SLURM cluster (sbatch/srun)"

CATALOG: dict[str, Entry] = {
    # -- README.md ---------------------------------------------------------------------------------------------
    "make demo": RanBy(DOC_LAUNCH, "`python -m hf_dist.demo`: what make demo runs after make install (.ci/run's)"),
    "make test": RanBy(CI),
    'make test TORCH_SPEC="torch>=2.13"': CannotRun(f"{NO_GPU}: installs torch's CUDA wheels (multi-GB, network)"),
    "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 8 train.py": RanBy(
        CONFIGS, "ddp.yaml on 2 CPU ranks; README's train.py: tests/unit/test_readme_snippet.py"
    ),
    "hf-dist plan ... --pure-bf16": RanBy("tests/unit/runtime/test_precision.py::test_cli_plan_pure_bf16"),
    "hf-dist plan --help": RanBy(
        "tests/unit/planning/test_request.py::test_every_field_says_what_it_is_and_every_section_field_is_a_flag_with_that_text"
    ),
    "hf-dist plan ./my-llama --gpus 8 --gpu-memory 80 --global-batch 64": Run(
        (Plan("zero2"),), setup=(ModelConfig("my-llama"),)
    ),
    "hf-dist plan ./config.json --gpus 1 --gpu-memory 24 --method lora --json": Run(
        (Plan("ddp"),), setup=(ModelConfig("config.json"),)
    ),
    "hf-dist env": Run((Exits(says=("torch",)),)),
    "python benchmarks/gpu_ground_truth.py": RanBy(
        "tests/unit/planning/test_gpu_ground_truth.py::test_every_case_meets_the_memory_targets",
        "the benchmark's own table, computed from the recorded H100 runs in benchmarks/data/gpu/",
    ),
    "python benchmarks/gpu_ground_truth.py --trace": CannotRun(
        "a benchmark: traces every GPU run the tracer runs, 3 min on 2 busy cores (2026-11-27)",
        output=(
            "docs/measurements.md",
            "| llama-3-8b lora ddp seq2048 mb8 liger load=bfloat16 | H200 | 101.49 | 107.30 | 107.32 | 1.000 | 4.50 | 4.47 | 0.88 |",
        ),
    ),
    "python benchmarks/planner_accuracy.py": CannotRun(
        "a benchmark: one 2-4 rank launch per model and layout, 14 min 55 s on 2 cores",
        output=("docs/measurements.md", "14 min 55 s on 2 busy CPU cores on 2026-11-25"),
    ),
    "python benchmarks/plan_speed.py --runs 5": CannotRun(
        "a benchmark: 30 fresh processes, about 2 min on 2 cores",
        output=(
            "docs/measurements.md",
            "| plan, Mixtral 8x7B (same request; counted on the meta model until 2026-11-30) | 0.46 | 0.10 |",
        ),
    ),
    "hf-dist plan ./llama-3-8b --gpus 8 --gpu-memory 80 --global-batch 64 --seq-len 4096 --verify": CannotRun(
        "a measurement: two traces of an 8B model, about 2 min on 2 quiet cores",
        output=("docs/measurements.md", "126 s wall, 178 s CPU"),
    ),
    "hf-dist plan MODEL ... --verify": RanBy("tests/unit/tracing/test_checked_plan.py::test_cli_verify_8b_on_64_gpus"),
    CONVERT: Run((HfFolder("out/hf-model"),), setup=(OUT_CKPT,)),
    "hf-dist convert out/checkpoint-500 out/adapter --adapter": Run(
        (AdapterFolder("out/adapter"),), setup=(LoraCheckpoint("out/checkpoint-500"),)
    ),
    "hf-dist convert out/hf-model out/init-dcp --to dcp": Run(
        (DcpFolder("out/init-dcp", source="out/hf-model"),), setup=(OUT_CKPT,), after=(CONVERT,)
    ),
    "hf-dist verify out/checkpoint-500 out/hf-model --atol 1e-2 --logits": Run(
        (Verified(),), setup=(OUT_CKPT,), after=(CONVERT,)
    ),
    "accelerate launch recipes/sft.py": Launch(
        (Recipe("outputs/sft", "ddp", 1, checkpoints=(2,)),), extra=SHORT, env=PLAIN
    ),
    SFT_8B: Launch(
        (Recipe("out/sft-8b", "ddp", 2, checkpoints=(2,)),),
        setup=(TinyModel("tiny-llama"), ChatData("chat.jsonl")),
        extra=SHORT,
        env=PLAIN,
    ),
    "torchrun --nproc_per_node=8 --max-restarts=3 train.py": RanBy(RESTARTS, "2 ranks, --max-restarts=2"),
    "hf-dist reshard out/checkpoint-500": RanBy(
        "tests/distributed/test_reshard.py::test_resume_on_other_world_size",
        "in place, by the function the command calls, on real ZeRO-2/3 checkpoints of 2 ranks",
    ),
    "make test-min": RanBy(CI),
    "make install": RanBy(CI),
    "make lint": RanBy(CI),
    # -- docs/architecture.md ----------------------------------------------------------------------------------
    "torchrun --max-restarts": RanBy(RESTARTS),
    # -- docs/bench.md -----------------------------------------------------------------------------------------
    "hf-dist bench --nproc 8 --model meta-llama/Llama-3.1-8B --seq-len 2048 --micro-batch-size 1 --autotune "
    "best.yaml": CannotRun(f"{NO_GPU} (8 processes) and hub access"),
    "hf-dist bench --nproc 8 --model ./my-model --strategies fsdp_full_shard,zero3 --json bench.json": CannotRun(
        f"{NO_GPU} (8 processes)"
    ),
    "hf-dist bench --nproc 2 --steps 5 --warmup 2 --json bench.json --autotune best.yaml": CannotRun(
        "a benchmark: 12 launches, 2 min 45 s on 2 idle cores; its 4-launch form is the next line",
        output=("docs/measurements.md", "wrote best.yaml (ddp)"),
    ),
    "hf-dist bench --nproc 2 --strategies ddp,fsdp_full_shard --steps 2 --warmup 1 --seq-len 32 --autotune "
    "best.yaml --json bench.json": RanBy("tests/distributed/test_bench.py::test_bench_cli_measures_and_autotunes"),
    # -- docs/callbacks.md -------------------------------------------------------------------------------------
    "python benchmarks/callback_overhead.py --repeats 6 --steps 40": CannotRun(
        "a benchmark: 12 timed runs of 40 steps (minutes); timings, not assertions",
        output=("docs/callbacks.md", "direct: 2.237 ms/step inside hf_dist callbacks = 0.71% of a 316.20 ms step"),
    ),
    "python -m pytest -q tests/unit/callbacks tests/unit/planning/test_flops.py": SUITE,
    "python -m pytest -q tests/distributed/test_callbacks_ddp.py": SUITE,
    "python -m pytest -q tests/distributed/test_callbacks_deepspeed.py": SUITE,
    "python -m pytest -q tests/distributed/test_callbacks_fsdp.py": SUITE,
    # -- docs/configs.md ---------------------------------------------------------------------------------------
    "hf-dist config ...": RanBy("tests/unit/configs/test_cli_config.py::test_writes_accelerate_yaml"),
    "hf-dist config --pure-bf16": RanBy("tests/unit/runtime/test_precision.py::test_cli_config_pure_bf16"),
    "accelerate launch --config_file accelerate_configs/ddp.yaml": RanBy(CONFIGS),
    "torchrun --nproc_per_node 2 train.py": RanBy(
        DOC_LAUNCH, "`torchrun --nproc_per_node 2 recipes/sft.py`: a train.py that calls auto_args"
    ),
    "accelerate launch --num_processes 2 ...": RanBy(
        DOC_LAUNCH, "`accelerate launch --num_processes 2`: with recipes/sft.py"
    ),
    "hf-dist plan --fused-lm-head": RanBy("tests/unit/test_cli_plan.py::test_plan_fused_lm_head_and_host_ram_at_load"),
    "hf-dist config --strategy fsdp_full_shard --tp-size 2 --out fsdp2_tp2.yaml": Run((ConfigWritten(),)),
    "hf-dist config --strategy fsdp_full_shard --cp-size 2 --out fsdp2_cp2.yaml": Run((ConfigWritten(),)),
    "hf-dist config --strategy zero2 --sp-size 2 --out zero2_sp2.yaml": Run((ConfigWritten(),)),
    "hf-dist config --strategy zero2 --tp-size 2 --format deepspeed --out ds_autotp.json": Run((ConfigWritten(),)),
    "hf-dist config --strategy zero2 --tp-size 2 --deepspeed-config-file ds_autotp.json --out zero2_autotp.yaml": Run(
        (ConfigWritten(),),
        after=("hf-dist config --strategy zero2 --tp-size 2 --format deepspeed --out ds_autotp.json",),
    ),
    "hf-dist config --strategy zero3 --offload optimizer+params --offload-device nvme --nvme-path /local_nvme/ds "
    "--format deepspeed --out ds_nvme.json": Run((ConfigWritten(),)),
    "hf-dist config --strategy fsdp_full_shard --out fsdp.yaml": Run((ConfigWritten(),)),
    "hf-dist config --strategy zero3 --offload optimizer+params --out zero3_offload.yaml": Run((ConfigWritten(),)),
    "hf-dist config --strategy hsdp --nodes 4 --num-processes 32 --out hsdp.yaml": Run((ConfigWritten(),)),
    "hf-dist config --strategy zero2 --format deepspeed --out ds_zero2.json": Run((ConfigWritten(),)),
    'python -c "import time; from transformers import LlamaConfig; from hf_dist.planning.wrap import '
    "fsdp_wrap_classes; cfg=LlamaConfig(hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,"
    "num_attention_heads=64,num_key_value_heads=8,vocab_size=128256); t=time.perf_counter(); "
    'print(fsdp_wrap_classes(cfg), time.perf_counter()-t)"': Run((Exits(says=("['LlamaDecoderLayer']",)),)),
    'python -c "from hf_dist.tracing.speed import dispatch_rate as r; print(r())"': Run((Exits(),)),
    # -- docs/convert.md ---------------------------------------------------------------------------------------
    "hf-dist convert out/checkpoint-500/global_step500 out/hf-model": Run(
        (HfFolder("out/hf-model"),), setup=(OUT_CKPT,)
    ),
    "hf-dist convert out/checkpoint-500 out/hf-fp32 --dtype fp32 --max-shard-size 2GB": Run(
        (HfFolder("out/hf-fp32", dtype="float32"),), setup=(OUT_CKPT,)
    ),
    "hf-dist convert ds_ckpt/ out/hf --tag global_step200 --model-config base/ --tokenizer base/": Run(
        (HfFolder("out/hf", tokenizer=True),),
        setup=(ZeroCheckpoint("ds_ckpt", tag="global_step200", config_at="base"),),
    ),
    "hf-dist convert out/checkpoint-500 out/merged --merge-adapter": Run(
        (HfFolder("out/merged"),), setup=(LoraCheckpoint("out/checkpoint-500"),)
    ),
    "hf-dist convert out/checkpoint-500 out/hf-model --trust-remote-code": RanBy(
        "tests/unit/checkpoint/test_remote_code.py::test_with_the_flag_the_folder_code_runs_and_the_checkpoint_converts",
        "needs a config whose auto_map code runs: the test's own folder",
    ),
    "hf-dist verify out/checkpoint-500 out/hf-model --atol 1e-2 --logits --trust-remote-code": RanBy(
        "tests/unit/checkpoint/test_remote_code.py::test_with_the_flag_the_folder_code_runs_and_the_checkpoint_converts"
    ),
    "python benchmarks/convert_bench.py --sizes 150M 500M --runs 3": CannotRun(
        "a benchmark: trains and converts 148M and 494M-parameter checkpoints 3 times each (tens of minutes)",
        output=("docs/measurements.md", "Checkpoints: Llama, vocab 32000, head_dim 64, 14 layers"),
    ),
    # -- docs/recipes.md: packing ---------------------------------------------------------------------------------
    "pip install -e .[bench]": CannotRun(
        "installs the [bench] extra's corpus package from the registry (no install step runs from the docs' text)"
    ),
    "nice -n 5 python benchmarks/packing.py": CannotRun(
        "a benchmark: three 2-rank runs on 4,017 real conversations at seq_len 2,048 (21 min on 2 shared cores)",
        output=("docs/measurements.md", "| recipe packed (`sft.py --dataset chat.jsonl`) | 7,746 | 3.07x |"),
    ),
    "python -m pytest -q tests/unit/checkpoint": SUITE,
    "python -m pytest -q tests/distributed/test_convert.py": SUITE,
    # -- docs/fault-tolerance.md -------------------------------------------------------------------------------
    "hf-dist config --force": RanBy("tests/unit/configs/test_cli_config.py::test_refuses_overwrite_without_force"),
    "python benchmarks/async_save.py --saves 2 --save-steps 4 --host-idle-s 3": CannotRun(
        "a benchmark: a 551M-parameter FSDP2 model on 2 ranks, 14 min",
        output=("docs/fault-tolerance.md", "async stall / sync stall: 0.073 (target <= 0.10)"),
    ),
    "python benchmarks/async_save.py --layers 2 --saves 2 --save-steps 4": CannotRun(
        "a benchmark: a 155M-parameter FSDP2 model on 2 ranks, 4 min",
        output=("docs/fault-tolerance.md", "async stall / sync stall: 0.982 (target <= 0.10)"),
    ),
    "python -m pytest -q tests/distributed/test_hang.py": SUITE,
    "torchrun --max-restarts=K": RanBy(RESTARTS),
    "accelerate launch --multi_gpu --max_restarts K": CannotRun(
        f"{NO_GPU}: on CPU ranks accelerate uses its simple launcher, which does not restart"
    ),
    "deepspeed ...": RanBy(f"{MULTINODE}test_deepspeed_hostfile_two_nodes_zero3", "the DeepSpeed launcher"),
    "python benchmarks/gloo_exit.py --runs 60 --nproc 3": CannotRun(
        "a benchmark: 120 three-rank launches counting rare aborts (tens of minutes)",
        output=("docs/fault-tolerance.md", "plain exit 1 failed of 60, `shutdown()` 0 of 60"),
    ),
    "python -m pytest -q tests/distributed/test_fault_tolerance.py": SUITE,
    "python -m pytest -q tests/unit/callbacks": SUITE,
    # -- docs/multinode.md -------------------------------------------------------------------------------------
    "hf-dist config --strategy fsdp_full_shard --nodes 4 --out fsdp_4node.yaml": Run((ConfigWritten(),)),
    "accelerate launch --config_file accelerate_configs/hsdp_2node.yaml --machine_rank 0 --main_process_ip 10.0.0.1 "
    "--main_process_port 29500 recipes/sft.py --output_dir out/run1": RanBy(
        f"{MULTINODE}test_accelerate_two_nodes_hsdp_yaml", "machine ranks 0 and 1 on loopback, 2 ranks each"
    ),
    "torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 --master_addr 10.0.0.1 --master_port 29500 train.py": RanBy(
        f"{MULTINODE}test_torchrun_two_nodes_hsdp", "two node ranks on loopback, 2 ranks each"
    ),
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id job42 "
    "--max_restarts 3 train.py": CannotRun(f"{TWO_HOSTS}: the c10d rendezvous endpoint is another machine"),
    "srun --ntasks-per-node=1": CannotRun(SLURM),
    "accelerate launch --machine_rank $SLURM_NODEID": RanBy(f"{MULTINODE}test_accelerate_two_nodes_hsdp_yaml"),
    "torchrun --rdzv_backend c10d": CannotRun(f"{TWO_HOSTS} (a SLURM allocation)"),
    "deepspeed --hostfile --no_ssh --node_rank $SLURM_NODEID": RanBy(
        f"{SLURM_SCRIPTS}test_sbatch_script_trains_on_two_nodes_and_a_requeue_resumes",
        "deepspeed_multinode.sbatch runs it on each of 2 loopback nodes through the srun stand-in",
    ),
    "sbatch --nodes 4 examples/slurm/accelerate_multinode.sbatch": CannotRun(SLURM),
    "CONFIG=accelerate_configs/zero3.yaml sbatch examples/slurm/accelerate_multinode.sbatch": CannotRun(SLURM),
    "sbatch examples/slurm/deepspeed_multinode.sbatch --max_steps 1000 --save_steps 100": RanBy(
        f"{SLURM_SCRIPTS}test_sbatch_script_trains_on_two_nodes_and_a_requeue_resumes",
        "the script run as sbatch would, srun/scontrol stand-ins, 2 nodes on loopback, --max_steps 3 then 5",
    ),
    "sbatch examples/slurm/torchrun_multinode.sbatch --max_steps 1000 --save_steps 100": RanBy(
        f"{SLURM_SCRIPTS}test_sbatch_script_trains_on_two_nodes_and_a_requeue_resumes",
        "the script run as sbatch would, srun/scontrol stand-ins, 2 nodes on loopback, --max_steps 3 then 5",
    ),
    "python -m hf_dist.configs.launch_mesh CONFIG NODES GPUS_PER_NODE": RanBy(
        f"{SLURM_SCRIPTS}test_accelerate_script_refuses_a_mesh_the_allocation_cannot_hold",
        "accelerate_multinode.sbatch runs it (fitting and refusing); its flags: test_hsdp_mesh_follows_the_allocation",
    ),
    "python -m pytest -q tests/distributed/test_slurm_scripts.py": SUITE,
    "deepspeed --hostfile examples/hostfile --master_addr node-001 --master_port 29500 recipes/sft.py --deepspeed "
    "ds_zero3.json --output_dir out/run1": CannotRun(f"{TWO_HOSTS} and ssh between them (pdsh fan-out)"),
    "deepspeed --hostfile examples/hostfile --no_ssh --node_rank 0 --master_addr 10.0.0.1 --master_port 29500 "
    "recipes/sft.py --deepspeed ds_zero3.json --output_dir out/run1": RanBy(
        f"{MULTINODE}test_deepspeed_hostfile_two_nodes_zero3", "node ranks 0 and 1 on loopback"
    ),
    "accelerate launch --config_file accelerate_configs/zero3.yaml --num_machines 2 ...": RanBy(
        f"{MULTINODE}test_accelerate_two_nodes_ddp_template", f"the same two-machine rendezvous; zero3.yaml: {CONFIGS}"
    ),
    "torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 2 --master_addr 127.0.0.1": RanBy(
        f"{MULTINODE}test_torchrun_two_nodes_hsdp"
    ),
    "accelerate launch --config_file accelerate_configs/hsdp_2node.yaml --num_processes 4 "
    "--parallelism_config_dp_shard_size 2 --machine_rank {0,1} --main_process_ip 127.0.0.1": RanBy(
        f"{MULTINODE}test_accelerate_two_nodes_hsdp_yaml"
    ),
    "accelerate launch --config_file accelerate_configs/multi_node_template.yaml --num_processes 2 --machine_rank "
    "{0,1}": RanBy(f"{MULTINODE}test_accelerate_two_nodes_ddp_template"),
    "deepspeed --hostfile H --no_ssh --node_rank {0,1} --master_addr 127.0.0.1": RanBy(
        f"{MULTINODE}test_deepspeed_hostfile_two_nodes_zero3"
    ),
    "python -m pytest -q tests/distributed/test_multinode.py": SUITE,
    # -- docs/parallelism.md -----------------------------------------------------------------------------------
    "hf-dist plan --offload-device nvme": RanBy(
        "tests/unit/test_cli_plan.py::test_plan_pinned_to_nvme_states_the_swap_files"
    ),
    "python benchmarks/parallelism_examples.py": Launch(
        (Exits(), CopiedOutput("docs/parallelism.md", "## Llama-3.1-8B at 128k-token context on 8 x 80 GB"))
    ),
    "accelerate launch --config_file accelerate_configs/fsdp2_tp2.yaml train.py": CannotRun(
        f"{NO_GPU}: accelerate's TP needs CUDA; the same layout through TrainingArguments: "
        "tests/distributed/test_tensor_parallel.py::test_fsdp2_x_tp_uses_a_2d_mesh"
    ),
    "torchrun --nproc_per_node 4": RanBy("tests/distributed/test_tensor_parallel.py::test_fsdp2_x_tp_uses_a_2d_mesh"),
    "accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train.py": CannotRun(
        f"{NO_GPU}: context parallelism has no CPU attention rule (refused on CPU: tests/unit/configs/test_accelerate.py)"
    ),
    "accelerate launch --config_file accelerate_configs/zero2_sp2.yaml train.py": CannotRun(
        f"{NO_GPU}: the YAML's CPU form runs as the recipe's --sp_size 2: "
        "tests/distributed/test_recipes.py::test_sp_recipe_runs_ulysses_sequence_parallel"
    ),
    "hf-dist config --strategy zero2 --tp-size 2 --format deepspeed --out ds.json": Run((ConfigWritten(),)),
    ".venv/bin/python -m pytest tests/distributed/test_tensor_parallel.py tests/distributed/test_sequence_parallel.py "
    "-q": SUITE,
    "torchrun --nproc_per_node 2": RanBy(
        "tests/distributed/test_tensor_parallel.py::test_tp2_shards_every_linear_and_the_embeddings"
    ),
    "hf-dist convert <dir> out/hf --model-config <model folder>": RanBy(
        "tests/distributed/test_tensor_parallel.py::test_tp_dcp_checkpoint_converts_to_an_hf_folder"
    ),
    "make aio-op": RanBy(CI),
    ".venv/bin/python -m pytest tests/distributed/test_nvme_offload.py -q": SUITE,
    "python benchmarks/planner_accuracy.py --strategies zero3+nvme": CannotRun(
        "a benchmark: ZeRO-Infinity launches of three models on 2 ranks (minutes, libaio)",
        output=("docs/parallelism.md", "| C | 25.6M | 1307.2 | 1307.2 | 1.000 | 203.5 | 203.5 | 1.000 |"),
    ),
    # -- docs/planner.md ---------------------------------------------------------------------------------------
    "hf-dist plan meta-llama/Llama-3.1-8B --gpus 8 --gpu-memory 80 --global-batch 64": Run(
        (Plan("zero2"),), setup=(ModelConfig("llama-3.1-8b"),)
    ),
    "hf-dist plan ./my-model --gpus 16 --nodes 2 --gpu-memory 80": Run(
        (Plan("hsdp"),), setup=(ModelConfig("my-model"),)
    ),
    "hf-dist plan ./my-model/config.json --gpus 1 --gpu-memory 24 --method lora --json": Run(
        (Plan("ddp"),), setup=(ModelConfig("my-model/config.json"),)
    ),
    "hf-dist plan ./llama-3.1-8b/config.json --gpus 8 --gpu-memory 80 --global-batch 64": Run(
        (Plan("zero2"), CopiedOutput("docs/planner.md", "chosen: zero2, offload=none")),
        setup=(ModelConfig("llama-3.1-8b/config.json"),),
    ),
    "hf-dist plan ... --train-tokens 2e9": RanBy("tests/unit/test_cli_plan.py::test_plan_time_to_finish"),
    "hf-dist plan --seq-len": RanBy(
        "tests/unit/test_cli_plan.py::test_plan_refuses_a_seq_len_beyond_the_positions_in_one_line"
    ),
    "hf-dist plan ./llama-3-70b --gpus 2 --gpu-memory 80": Run(
        (
            Refusal("hf-dist plan: error: nothing fits on 2 x 80 GiB:"),
            CopiedOutput("docs/planner.md", "nothing fits on 2 x 80 GiB:"),
        ),
        setup=(ModelConfig("llama-3-70b", "Llama-3-70B"),),
    ),
    "hf-dist plan ./custom-model --gpus 8 --gpu-memory 80 --trust-remote-code": RanBy(
        "tests/unit/test_cli_remote_code.py::test_hf_dist_plan_with_the_flag_imports_and_plans_the_folder_model",
        "needs a folder whose auto_map code runs: the test's own",
    ),
    "torchrun --nproc_per_node 2 tests/distributed/scripts/load_rss.py MODEL_DIR OUT": RanBy(
        "tests/distributed/test_load_memory.py::test_an_fp32_load_of_a_16_bit_checkpoint_peaks_at_the_planned_figure"
    ),
    "python benchmarks/cpu_throughput.py": RanBy(
        "tests/distributed/test_bench.py::test_cpu_throughput_benchmark_runs_as_documented", "with fewer steps"
    ),
    "hf-dist plan --liger on --gpu-memory 80 ...": RanBy(PLAN_FLAGS, "--liger on|off reaches the planner"),
    "python benchmarks/trace_accuracy.py": CannotRun(
        "a benchmark: traces of public models' configs on 8-512 ranks, 805 s on 2 cores",
        output=(
            "docs/measurements.md",
            "| llama-3.2-1b | ddp w8 lora seq2048 mb1 | 9.61 | 9.62 | 1.001 | yes | 7.8 |",
        ),
    ),
    "python benchmarks/trace_accuracy.py --gpu-only": CannotRun(
        "a benchmark: traces every GPU run (14 traces, 310 s on 2 shared cores)",
        output=(
            "docs/measurements.md",
            "| llama-3.2-3b ddp w1 full ga2 seq4096 mb4 liger | H200 | 108.50 | 108.42 | 0.999 | 110.94 |",
        ),
    ),
    "python benchmarks/trace_accuracy.py --deepspeed-only --skip-gpu --only llama-3.2-1b llama-3-8b qwen2.5-7b "
    "mixtral-8x7b --out ds.json": CannotRun(
        "a benchmark: 24 traces of DeepSpeed's engine on 8 and 64 ranks, 3895 s on 2 busy cores",
        output=(
            "docs/measurements.md",
            "| llama-3-8b | zero3 w64 full+ckpt seq8192 mb1 | 18.99 | 0.896 | 0.994 | yes | 264 |",
        ),
    ),
    "python benchmarks/trace_accuracy.py --moe --skip-gpu --out moe.json": CannotRun(
        "a benchmark: 24 traces of three mixtures of experts on 8 and 64 ranks, 282 s on 2 busy cores",
        output=(
            "docs/measurements.md",
            "| qwen1.5-moe-a2.7b | fsdp_full_shard w64 lora+ckpt seq8192 mb1 | 15.82 | 15.81 |",
        ),
    ),
    "python benchmarks/trace_accuracy.py --moe-planned --skip-gpu --out moe_planned.json": CannotRun(
        "a benchmark: 59 layouts the planner picks for three mixtures of experts, 1477 s on 2 busy cores",
        output=(
            "docs/measurements.md",
            "| deepseek-v2-lite | fsdp_full_shard tp8 w64 full+ckpt seq4096 mb2 | 13.21 | 13.18 | 0.998 |",
        ),
    ),
    "python benchmarks/trace_accuracy.py --skip-models --gpu-only llama-3-8b": CannotRun(
        "a benchmark: one 8B trace, 48 s on 2 idle cores, 250 s on busy ones",
        output=("docs/measurements.md", "# traced 80.49 GiB"),
    ),
    "hf-dist plan --lora-rank 64 --lora-dropout 0 --lora-targets q_proj v_proj": RanBy(
        "tests/unit/test_cli_plan.py::test_plan_lora_flags_plan_that_lora", "the flags, with a model folder"
    ),
    "hf-dist plan ... --verify": RanBy("tests/unit/tracing/test_checked_plan.py::test_cli_verify_8b_on_64_gpus"),
    "hf-dist plan ./llama-3-8b --gpus 64 --nodes 8 --gpu-memory 80 --global-batch 256 --verify": RanBy(
        "tests/unit/tracing/test_checked_plan.py::test_cli_verify_8b_on_64_gpus",
        "the doc says this test runs the line",
    ),
    "python benchmarks/lora_ops.py": CannotRun(
        "a benchmark: counts the kernels of LoRA layers under torch's profiler (minutes)",
        output=("docs/planner.md", "143 kernels per full-fine-tuning Llama layer, 242 with 7 adapters"),
    ),
    # -- docs/recipes.md ---------------------------------------------------------------------------------------
    "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no "
    "--dynamo_backend no recipes/sft.py --tp_size 2 --model_parallel_on_cpu": RanBy(
        "tests/distributed/test_recipes.py::test_tp_recipe_runs_tensor_parallel"
    ),
    "python -m hf_dist.demo": Launch(
        (Exits(says=DEMO_SAYS),),
        extra=("--steps", "2"),  # what README says the demo prints, after 2 steps
    ),
    "accelerate launch --num_processes 2": Launch(
        (
            Refusal(
                "accelerate launch was asked for --num_processes 2 but started this one process", first_printed=False
            ),
        ),
        extra=("recipes/sft.py", *SHORT),
        env=PLAIN,
    ),
    "torchrun --nproc_per_node 2 recipes/sft.py": Launch(
        (Recipe("outputs/sft", "ddp", 2, checkpoints=(2,)),), extra=SHORT, env=PLAIN
    ),
    "torchrun --nproc_per_node 8 --max-restarts 3 recipes/sft.py --output_dir out/sft-8b --resume_from_checkpoint "
    "auto ...": Launch(
        (Restarts("out/sft-8b", resumes_from=2), Recipe("out/sft-8b", "ddp", 2, checkpoints=(2, 4))),
        after=(SFT_8B,),  # the run the doc's previous line started (2 steps): resumed to 4, then rerun finished
        extra=("--model_name_or_path", "./tiny-llama", "--dataset", "chat.jsonl", *SHORT, "--max_steps", "4"),
        runs=((), ()),
        env=PLAIN,
    ),
    "python -m pytest -q tests/unit/test_data.py tests/unit/test_recipe_utils.py": SUITE,
    "python -m pytest -q tests/distributed/test_recipes.py": SUITE,
    # -- docs/resume-world-size.md -----------------------------------------------------------------------------
    "hf-dist reshard out/checkpoint-500 --check 16": Run(
        (Exits(says=("needs `hf-dist reshard out/checkpoint-500` (saved by 2 ranks, resuming on 16)",)), Unchanged()),
        setup=(OUT_CKPT,),
    ),
    "hf-dist reshard out/checkpoint-500 out/ckpt-any-world": RanBy(
        "tests/distributed/test_reshard.py::test_cli_reshard_into_copy", "real ZeRO-2/3 and FSDP2 checkpoints"
    ),
    "python -m pytest -q tests/distributed/test_reshard.py": SUITE,
    # -- docs/testing.md ---------------------------------------------------------------------------------------
    "make libaio": RanBy(CI),
    "python -m pytest -q tests/unit/test_doc_commands.py": SUITE,
    ".venv/bin/python -m pytest -q --durations=30 tests": SUITE,
    "python -m pytest -q tests/unit": SUITE,
    "python -m pytest -q -m distributed tests/distributed": SUITE,
    'python -m pytest -q -m "not distributed" tests': SUITE,
    "python -m pytest -q tests/distributed/test_strategies.py tests/distributed/test_accelerate_configs.py": SUITE,
    "python -m pytest -q tests/distributed/test_strategies.py": SUITE,
    "accelerate launch --config_file accelerate_configs/<name>.yaml --num_processes 2 --main_process_ip 127.0.0.1 "
    "--main_process_port <free> --mixed_precision no tests/distributed/scripts/strategies_minimal.py "
    "--out report.json": RanBy(CONFIGS),
    "HF_DIST_FSDP_ON_CPU=1 torchrun --nproc_per_node 2 my_script.py": RanBy(
        "tests/distributed/test_strategies.py::test_strategy_really_ran"
    ),
    "HF_DIST_FSDP_ON_CPU=1 ACCELERATE_USE_CPU=1 accelerate launch --config_file "
    "accelerate_configs/fsdp2_full_shard.yaml --num_processes 2 --mixed_precision no my_script.py": RanBy(CONFIGS),
}
