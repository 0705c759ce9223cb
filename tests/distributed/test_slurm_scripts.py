"""The shipped SLURM scripts run end to end, and a requeued job resumes: two "nodes" on loopback, no SLURM.

``srun`` and ``scontrol`` are stand-ins put first on PATH (tests/distributed/scripts/slurm_standins/):
``scontrol show hostnames`` names ``localhost`` and ``node-1``; ``srun`` starts the script's per-node command once per
node with ``SLURM_NODEID``/``SLURM_PROCID`` set, each in its own process group, as ``srun --ntasks-per-node=1`` does.
The script itself runs as ``sbatch`` would run it (bash, SLURM's variables in the environment), in a folder standing
for the repository root, with recipe flags appended as ``sbatch SCRIPT FLAGS...`` passes them.

Each script trains the embedded default recipe 3 steps with ``--save_steps 2`` (checkpoints 2 and 3), then runs again
as a requeue does (same job id, so the same ``out/<job id>``) with ``--max_steps 5``: the second run must say
``[hf_dist] resuming from out/<id>/checkpoint-3`` and end at step 5. The accelerate script runs its default
``hsdp_2node.yaml``, whose 2 x 8 mesh the script refits to the 2 x 2 allocation (an HSDP (2, 2) mesh). The torchrun
script also survives a rank killed inside the job (``--max_restarts``), with the lifecycle script as its ``SCRIPT``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_dist.configs.launch_mesh import mesh_flags
from hf_dist.testing import GLOO_ABORT, REPO_ROOT, cpu_env, free_port

pytestmark = pytest.mark.distributed

STANDINS = Path(__file__).parent / "scripts" / "slurm_standins"
SLURM = REPO_ROOT / "examples" / "slurm"
LIFECYCLE = REPO_ROOT / "tests" / "distributed" / "scripts" / "lifecycle_train.py"
TIMEOUT_S = 300
RECIPE = ("--tiny_hidden_size", "64", "--num_train_examples", "64", "--num_eval_examples", "8", "--save_steps", "2")
# script -> (GPUs per node, recipe flags of that launch on CPU)
SCRIPTS = {
    "torchrun_multinode.sbatch": (1, ()),
    "accelerate_multinode.sbatch": (2, ("--fsdp_on_cpu",)),  # hsdp_2node.yaml: FSDP2 on CPU ranks is opt-in
    "deepspeed_multinode.sbatch": (1, ("--deepspeed_on_cpu",)),  # ZeRO-3 from the JSON the script writes
}
ENV = {"deepspeed_multinode.sbatch": {"MIXED_PRECISION": "no"}}  # CPU ranks train in fp32
RUNS = {  # hsdp_2node.yaml's 2 x 8 mesh, refitted by the script to 2 x 2: FSDP2 on 4 ranks; the JSON's ZeRO-3
    "accelerate_multinode.sbatch": "[hf_dist] running fsdp_full_shard (fsdp2, LlamaForCausalLM)",
    "deepspeed_multinode.sbatch": "[hf_dist] running zero3 (deepspeed, LlamaForCausalLM)",
}


def sbatch(script: str, ws: Path, job_id: str, gpus: int, *flags: str, env: dict | None = None) -> tuple[int, str]:
    """Run ``script`` as sbatch would on a 2-node allocation of ``gpus`` per node, with ``env`` added to SLURM's
    variables; (exit code, its output)."""
    env = cpu_env(
        {
            **(env or {}),
            "PATH": os.pathsep.join([str(STANDINS), str(Path(sys.executable).parent), os.environ["PATH"]]),
            "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NAME": "hf-dist",
            "SLURM_JOB_NODELIST": "localhost,node-1",
            "SLURM_NNODES": "2",
            "SLURM_GPUS_ON_NODE": str(gpus),
            "MAIN_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    log = ws / f"sbatch-{time.monotonic_ns()}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(SLURM / script), *flags], cwd=ws, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the srun stand-in takes every node down with it
            proc.wait(timeout=30)
            return -1, f"timeout after {TIMEOUT_S}s\n" + log.read_text()
    return proc.returncode, log.read_text()


def run_job(script: str, ws: Path, job_id: str, gpus: int, *flags: str, env: dict | None = None) -> str:
    code, text = sbatch(script, ws, job_id, gpus, *flags, env=env)
    if code != 0 and GLOO_ABORT in text:  # gloo's rare abort at exit (hf_dist.testing.GLOO_ABORT): once more
        code, text = sbatch(script, ws, job_id, gpus, *flags, env=env)
    assert code == 0, f"{script} exited {code}:\n{text[-6000:]}"
    return text


def trained_steps(out: Path) -> int:
    return json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["global_step"]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_sbatch_script_trains_on_two_nodes_and_a_requeue_resumes(script, tmp_path):
    gpus, cpu_flags = SCRIPTS[script]
    for name in ("recipes", "accelerate_configs"):
        (tmp_path / name).symlink_to(REPO_ROOT / name, target_is_directory=True)
    job = "4242"
    out = tmp_path / "out" / job

    first = run_job(script, tmp_path, job, gpus, *RECIPE, *cpu_flags, "--max_steps", "3", env=ENV.get(script))
    assert f"[hf_dist] no checkpoint-N folder in out/{job}: starting from scratch" in first, first[-3000:]
    assert f"{2 * gpus} process(es)" in first, first[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]

    # the requeue: the same job id, hence the same folder, and a longer run
    second = run_job(script, tmp_path, job, gpus, *RECIPE, *cpu_flags, "--max_steps", "5", env=ENV.get(script))
    assert f"[hf_dist] resuming from out/{job}/checkpoint-3 at step 3" in second, second[-3000:]
    assert trained_steps(out) == 5
    for text in (first, second):  # what ran, both times
        assert RUNS.get(script, "") in text, text[-3000:]


# script -> what the kill test adds to its environment (accelerate: its DDP multi-node YAML, 1 rank per node)
KILL_ENV = {
    "torchrun_multinode.sbatch": {},
    "accelerate_multinode.sbatch": {"CONFIG": "accelerate_configs/multi_node_template.yaml"},
}


@pytest.mark.parametrize("script", list(KILL_ENV))
def test_script_restarts_a_rank_killed_inside_the_job_and_resumes(script, tmp_path):
    """kill -9 inside a job, not a requeue: rank 1 SIGKILLs itself at the end of step 3 (the lifecycle script as the
    sbatch script's ``SCRIPT``). The script's ``--max_restarts 3`` restarts both nodes' workers in the same job (c10d
    rendezvous; accelerate runs torchrun), and the new attempt resumes from checkpoint-2 and ends at step 6."""
    (tmp_path / "accelerate_configs").symlink_to(REPO_ROOT / "accelerate_configs", target_is_directory=True)
    job = "4343"
    out = tmp_path / "out" / job
    flags = ("--max-steps", "6", "--save-steps", "2", "--kill", "3:1")
    text = run_job(script, tmp_path, job, 1, *flags, env={"SCRIPT": str(LIFECYCLE), **KILL_ENV[script]})
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert (out / "killed_step_3").exists(), text[-3000:]
    assert [a["resume"] for a in attempts] == [None, f"out/{job}/checkpoint-2"], (attempts, text[-3000:])
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["global_step"] == 6


def test_accelerate_script_refuses_a_mesh_the_allocation_cannot_hold(tmp_path):
    """HSDP on 1 GPU per node leaves nothing to shard: one line, exit 2, before srun starts anything."""
    (tmp_path / "accelerate_configs").symlink_to(REPO_ROOT / "accelerate_configs", target_is_directory=True)
    code, text = sbatch("accelerate_multinode.sbatch", tmp_path, "7", 1)
    assert code == 2, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "leaves a dp_shard of 1" in lines[0], text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("nodes", "gpus", "replicate", "shard"), [(4, 8, 4, 8), (2, 4, 2, 4), (2, 8, 2, 8), (1, 8, 1, 8)]
)
def test_hsdp_mesh_follows_the_allocation(nodes, gpus, replicate, shard):
    import yaml

    config = yaml.safe_load((REPO_ROOT / "accelerate_configs" / "hsdp_2node.yaml").read_text())
    assert mesh_flags(config, nodes, gpus) == [
        "--parallelism_config_dp_replicate_size", str(replicate), "--parallelism_config_dp_shard_size", str(shard),
    ]  # fmt: skip
