"""Two nodes simulated on loopback: two launcher processes (node ranks 0 and 1) on this machine.

Covers the torchrun rendezvous (--nnodes 2 --node_rank R --master_addr 127.0.0.1), accelerate launch with the
shipped multi-node YAMLs (num_machines 2, --machine_rank R), DeepSpeed's launcher reading a hostfile (with
--no_ssh each node is started on its own, as here; the default pdsh/ssh fan-out needs real hosts), and HSDP on 2 nodes x 2 processes: parameters
sharded inside a node, replicated across nodes, i.e. a (dp_replicate=2, dp_shard=2) mesh [[0, 1], [2, 3]].
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

from hf_dist.testing import GLOO_ABORT, REPO_ROOT, cpu_env, free_port, relaunch_on_gloo_abort

SCRIPT = Path(__file__).parent / "scripts" / "multinode_hsdp.py"
CONFIGS = REPO_ROOT / "accelerate_configs"
TIMEOUT_S = 240

pytestmark = pytest.mark.distributed


def launch_two_nodes(launcher_for_node, out: Path) -> list[dict]:
    """Start one launcher per node rank at once (they rendezvous on a fresh port); return per-rank reports.

    ``launcher_for_node(node, port)`` is the command line of node ``node``. If one node's launcher fails, the other
    is killed at once instead of waiting for a peer that never comes; a gloo abort on either node is launched once
    more, as :func:`hf_dist.testing.torchrun` does.
    """
    relaunch_on_gloo_abort(lambda: _launch_both(launcher_for_node, free_port(), out), [out])
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _launch_both(launcher_for_node, port: int, out: Path) -> None:
    logs = [out / f"node{node}.log" for node in (0, 1)]
    procs = [
        subprocess.Popen(
            launcher_for_node(node, port),
            env=cpu_env(),
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a kill takes the launcher's ranks too
        )
        for node, log in zip((0, 1), logs, strict=True)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = False
    try:
        while any(p.poll() is None for p in procs) and not any(p.returncode not in (None, 0) for p in procs):
            if timed_out := time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    failed = [n for n, p in enumerate(procs) if p.returncode != 0]
    if failed:
        texts = [log.read_text() for log in logs]
        node = failed[0]
        why = f"timeout after {TIMEOUT_S}s" if timed_out else f"exit code {procs[node].returncode}"
        aborted = [n for n, text in enumerate(texts) if GLOO_ABORT in text]
        cause = f"node {aborted[0]}: {GLOO_ABORT}\n" if aborted else ""
        raise RuntimeError(f"{cause}node {node} launcher failed ({why}):\n{texts[node][-6000:]}")


def torchrun_node(nproc: int, out: Path, mode: str):
    def cmd(node: int, port: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
                str(SCRIPT), "--mode", mode, "--out", str(out)]  # fmt: skip

    return cmd


def accelerate_node(config: str, nproc_total: int, out: Path, mode: str, *extra: str):
    def cmd(node: int, port: int) -> list[str]:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                "--num_processes", str(nproc_total), "--machine_rank", str(node),
                "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no",
                *extra, str(SCRIPT), "--mode", mode, "--out", str(out)]  # fmt: skip

    return cmd


def check_hsdp(reports: list[dict]) -> None:
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    for r in reports:
        assert r["model_type"].startswith("FSDP"), r
        assert r["world_size"] == 4 and r["local_world_size"] == 2
        assert r["node_rank"] == r["rank"] // 2  # ranks 0,1 on node 0; 2,3 on node 1
        assert r["mesh_dim_names"] == ["dp_replicate", "dp_shard"] and r["mesh_shape"] == [2, 2]
        assert r["mesh"] == [[0, 1], [2, 3]]
        # shard inside a node, replicate across nodes
        assert r["shard_group"] == [2 * r["node_rank"], 2 * r["node_rank"] + 1]
        assert r["replicate_group"] == [r["rank"] % 2, r["rank"] % 2 + 2]
        assert r["placements"] == ["R", "S(0)"]
        assert r["local_shard_numel"] == 64 * 64 // 2  # q_proj split in two inside the node
    # each rank saw different data, so equal replicas after a step prove the cross-node gradient all-reduce
    for rank in (0, 1):
        assert reports[rank]["local_shard_sum"] == pytest.approx(reports[rank + 2]["local_shard_sum"], abs=1e-9)
    assert reports[0]["local_shard_sum"] != pytest.approx(reports[1]["local_shard_sum"])


def test_torchrun_two_nodes_hsdp(tmp_path):
    check_hsdp(launch_two_nodes(torchrun_node(2, tmp_path, "torch"), tmp_path))


def test_accelerate_two_nodes_hsdp_yaml(tmp_path):
    launcher = accelerate_node("hsdp_2node.yaml", 4, tmp_path, "accelerate", "--parallelism_config_dp_shard_size", "2")
    reports = launch_two_nodes(launcher, tmp_path)
    check_hsdp(reports)
    assert {r["distributed_type"] for r in reports} == {"DistributedType.FSDP"}


def test_accelerate_two_nodes_ddp_template(tmp_path):
    reports = launch_two_nodes(accelerate_node("multi_node_template.yaml", 2, tmp_path, "ddp"), tmp_path)
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in reports] == [
        (0, 0, 0, 2),
        (1, 1, 0, 2),
    ]
    assert [r["all_reduce_sum"] for r in reports] == [3.0, 3.0]  # 1 + 2 summed across the two nodes


def test_deepspeed_hostfile_two_nodes_zero3(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")  # the names are never resolved with --no_ssh

    def cmd(node: int, port: int) -> list[str]:
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                str(SCRIPT), "--mode", "deepspeed", "--out", str(tmp_path)]  # fmt: skip

    reports = launch_two_nodes(cmd, tmp_path)
    assert [(r["rank"], r["node_rank"], r["local_rank"], r["world_size"], r["nodes"]) for r in reports] == [
        (0, 0, 0, 2, 2),
        (1, 1, 0, 2, 2),
    ]
    assert [r["all_reduce_sum"] for r in reports] == [3.0, 3.0]  # one collective spanning both nodes
    for r in reports:  # ZeRO-3 partitions each parameter across the two nodes
        assert r["zero_stage"] == 3 and r["full_numel"] == 64 * 64 and r["partition_numel"] == 64 * 64 // 2
