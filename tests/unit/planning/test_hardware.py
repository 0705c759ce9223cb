"""Hardware detection: overrides, node count from launcher env, bf16 checks."""

import pytest

from hf_dist.planning import hardware
from hf_dist.planning.hardware import Hardware, detect_hardware, nodes_from_env, peak_tflops_for

FAKE_A100 = {"device": "cuda", "gpus_per_node": 8, "gpu_memory_gib": 79.2, "gpu_name": "NVIDIA A100-SXM4-80GB"}
FAKE_V100 = {"device": "cuda", "gpus_per_node": 4, "gpu_memory_gib": 31.7, "gpu_name": "Tesla V100-SXM2-32GB"}


@pytest.fixture
def no_launcher_env(monkeypatch):
    for key in ("NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)


def fake_cuda(monkeypatch, info, bf16):
    monkeypatch.setattr(hardware, "_detect_cuda", lambda: {**info, "bf16": bf16, "fp16": True})


def test_cpu_fallback(no_launcher_env):
    hw = detect_hardware()  # tests hide CUDA (conftest sets CUDA_VISIBLE_DEVICES="")
    assert hw.device == "cpu" and hw.world_size == 1 and hw.gpu_memory_gib > 0
    assert not hw.bf16
    two = detect_hardware(gpus=2)
    assert two.device == "cpu" and two.gpus_per_node == 2
    assert two.gpu_memory_gib == pytest.approx(hw.gpu_memory_gib / 2)  # CPU ranks share host RAM


def test_plan_a_cluster_from_a_laptop(no_launcher_env):
    hw = detect_hardware(gpus=16, nodes=2, gpu_memory_gib=80, gpu_name="NVIDIA H100 80GB HBM3")
    assert (hw.device, hw.gpus_per_node, hw.nodes, hw.world_size) == ("cuda", 8, 2, 16)
    assert hw.bf16 and hw.peak_tflops == 989.0


def test_detected_gpu_fields_and_overrides(monkeypatch, no_launcher_env):
    fake_cuda(monkeypatch, FAKE_A100, bf16=True)
    hw = detect_hardware()
    assert (hw.gpus_per_node, hw.gpu_memory_gib, hw.bf16, hw.peak_tflops) == (8, 79.2, True, 312.0)
    assert detect_hardware(gpu_memory_gib=40).gpu_memory_gib == 40.0
    assert detect_hardware(bf16=False).bf16 is False


def test_bf16_requested_on_gpu_without_it(monkeypatch, no_launcher_env):
    fake_cuda(monkeypatch, FAKE_V100, bf16=False)
    with pytest.raises(ValueError, match="does not support it; use fp16"):
        detect_hardware(bf16=True)
    assert detect_hardware().fp16


@pytest.mark.parametrize(
    ("env", "nodes"),
    [
        ({"NNODES": "4"}, 4),
        ({"SLURM_NNODES": "2"}, 2),
        ({"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"}, 4),
        ({"WORLD_SIZE": "8"}, None),
        ({}, None),
    ],
)
def test_nodes_from_env(env, nodes):
    assert nodes_from_env(env) == nodes


def test_nodes_env_used_by_detection(monkeypatch, no_launcher_env):
    monkeypatch.setenv("NNODES", "2")
    assert detect_hardware(gpus=16, gpu_memory_gib=80).gpus_per_node == 8


def test_gpus_not_divisible_by_nodes(no_launcher_env):
    with pytest.raises(ValueError, match=r"gpus \(10\) is not divisible by nodes \(4\)"):
        detect_hardware(gpus=10, nodes=4, gpu_memory_gib=80)


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"gpus": 0}, "gpus must be"), ({"gpu_memory_gib": -1}, "gpu_memory")]
)
def test_bad_overrides(kwargs, message):
    with pytest.raises(ValueError, match=message):
        detect_hardware(**kwargs)


def test_hardware_validation_and_peak_table():
    with pytest.raises(ValueError, match="device must be"):
        Hardware(device="tpu", gpus_per_node=1, gpu_memory_gib=16)
    with pytest.raises(ValueError, match="gpu_memory_gib must be a finite number > 0, got 0"):
        Hardware(device="cuda", gpus_per_node=1)
    assert peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops_for("NVIDIA L40S") == 362.0
    assert peak_tflops_for("NVIDIA GeForce RTX 4090") == 165.0
    assert peak_tflops_for("mystery accelerator") is None


def test_torch_is_asked_only_where_a_gpu_driver_shows(tmp_path):
    """On Linux without an NVIDIA or AMD driver torch sees no GPU, so detection does not import it (seconds of a
    plan); with a driver file present (a stand-in here) it asks torch, which answers for this CPU machine."""
    import subprocess
    import sys

    driver = tmp_path / "nvidiactl"
    code = (
        "import sys; from hf_dist.planning import hardware as h; h._DRIVER_FILES = (sys.argv[1],); "
        "print(h._detect_cuda(), 'torch' in sys.modules)"
    )
    run = [sys.executable, "-c", code, str(driver)]
    assert subprocess.run(run, capture_output=True, text=True, check=True).stdout.split() == ["None", "False"]
    driver.write_text("")
    assert subprocess.run(run, capture_output=True, text=True, check=True).stdout.split() == ["None", "True"]
