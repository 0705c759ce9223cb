"""Every shipped single-node accelerate config really drives ``accelerate launch`` on 2 CPU ranks.

``accelerate launch --config_file accelerate_configs/<name>.yaml`` runs
tests/distributed/scripts/strategies_minimal.py (a plain Accelerator loop, 3 fp32 steps), which
reports what accelerate actually did. The expectation for each file is read from the file itself
(distributed_type, fsdp_version, fsdp_reshard_after_forward, zero_stage, offload devices), so the
test checks that each key took effect on real ranks -- e.g. that FSDP was not silently dropped on
CPU and that ZeRO-3 partitioned the parameters -- and a newly shipped single-node config is
covered without editing this file. CPU overrides are explained in tests/distributed/conftest.py
(``launch_accelerate_config``) and docs/testing.md.
"""

from __future__ import annotations

import math

import pytest
import yaml

from tests.distributed.conftest import CONFIG_DIR

pytestmark = pytest.mark.distributed

# The shipped single-node configs (issue 2, item 6); multi-node ones are run by test_multinode.py.
EXPECTED_SINGLE_NODE = {"ddp", "fsdp2_full_shard", "fsdp2_shard_grad_op", "zero1", "zero2", "zero3", "zero3_offload"}


def load(name: str) -> dict:
    return yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())


# Model-parallel examples (TP, CP, SP): accelerate refuses any ParallelismConfig on MULTI_CPU ("only compatible
# DistributedType.FSDP (version 2) or ... Multi{Device} or DEEPSPEED") and torch's context_parallel has no CPU
# attention, so these are configured for GPUs only. tests/unit/test_shipped_configs.py loads them with accelerate's
# own loader; TP and Ulysses SP themselves run on CPU ranks in test_tensor_parallel.py / test_sequence_parallel.py.
GPU_ONLY = {"fsdp2_tp2", "fsdp2_cp2", "zero2_sp2"}
MODEL_PARALLEL_KEYS = ("parallelism_config_tp_size", "parallelism_config_cp_size", "parallelism_config_sp_size")


def single_node_configs(*, model_parallel: bool = False) -> list[str]:
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    single = [n for n in names if int(load(n).get("num_machines", 1)) == 1]
    return [n for n in single if _model_parallel(load(n)) == model_parallel]


def _model_parallel(config: dict) -> bool:
    sizes = config.get("parallelism_config") or {}
    return any(int(sizes.get(key, 1)) > 1 for key in MODEL_PARALLEL_KEYS)


def test_every_single_node_config_is_launched_here():
    assert set(single_node_configs()) == EXPECTED_SINGLE_NODE
    assert set(single_node_configs(model_parallel=True)) == GPU_ONLY


@pytest.mark.parametrize("name", single_node_configs())
def test_config_takes_effect(accelerate_runs, name):
    config = load(name)
    report = accelerate_runs.get(name)
    assert report["num_processes"] == 2
    assert report["mixed_precision"] == "no"  # the --mixed_precision no override won over the YAML's bf16
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"])
    kind = config["distributed_type"]
    if kind == "MULTI_GPU":
        assert report["distributed_type"] == "MULTI_CPU"  # DDP on CPU ranks
        assert report["model_type"] == "DistributedDataParallel"
    elif kind == "FSDP":
        fsdp = config["fsdp_config"]
        assert report["distributed_type"] == "FSDP", "accelerate dropped FSDP on CPU (HF_DIST_FSDP_ON_CPU=1?)"
        assert report["fsdp_version"] == int(fsdp["fsdp_version"]) == 2
        assert report["reshard_after_forward"] == bool(fsdp["fsdp_reshard_after_forward"])
        assert report["model_type"] == "FSDPLlamaForCausalLM"
        assert report["dtensor_params"] > 0
        assert 2 * report["dtensor_local_numel"] == report["dtensor_global_numel"]
    elif kind == "DEEPSPEED":
        ds = config["deepspeed_config"]
        assert report["distributed_type"] == "DEEPSPEED"
        assert report["model_type"] == "DeepSpeedEngine"
        assert report["zero_stage"] == int(ds["zero_stage"])
        assert report["engine_offload_optimizer"] == ds.get("offload_optimizer_device", "none")
        assert report["engine_offload_param"] == ds.get("offload_param_device", "none")
        if int(ds["zero_stage"]) == 3:
            assert report["zero3_params"] > 0
            half = report["ds_numel"] / 2
            assert half <= report["ds_partition_numel"] < half + report["zero3_params"]
        else:
            assert report["zero3_params"] == 0
    else:
        pytest.fail(f"{name}.yaml has distributed_type {kind!r}; this test knows MULTI_GPU, FSDP, DEEPSPEED")
