"""What we run on: device count and memory, bf16 support, nodes, link speeds. Every field is overridable.

Overrides let a user plan for a cluster from a laptop: ``detect_hardware(gpus=16, nodes=2,
gpu_memory_gib=80)`` describes two 8-GPU nodes whatever the local machine has.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

# Dense bf16 tensor-core TFLOPs per device from the vendors' datasheets (no sparsity). Matched by
# substring of torch.cuda.get_device_name(), most specific first.
PEAK_BF16_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM / HBM3
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("A6000", 155.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)
# Memory bandwidth in GB/s per device from the same datasheets, matched the same way.
PEAK_HBM_GBPS = (
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-40GB", 1555.0),
    ("A100", 2039.0),
    ("A800", 2039.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("A6000", 768.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("MI300X", 5300.0),
    ("MI250X", 3200.0),
)
# A CPU core's dense fp32 peak is measured, not looked up: cores differ by vector width (AVX2, AVX-512, NEON), FMA
# pipes and clock several-fold. One thread multiplies two 512 x 512 fp32 matrices (2 * 512**3 FLOPs: large enough for
# the BLAS to reach its steady rate, a few ms); the fastest of a few runs is the core's peak, what a datasheet's peak is
# to a GPU. On the 2-core AMD EPYC (Zen 4) of CI it measured 80-88 GFLOP/s, the core's documented 32 fp32 FLOPs per
# cycle (two 256-bit FMA pipes) at 2.6 GHz: 83 GFLOP/s (docs/planner.md, "Throughput on CPU ranks").
CPU_PROBE_SIZE = 512
CPU_PROBE_RUNS = 5


@dataclass(frozen=True)
class Hardware:
    """The machines a run uses; ``world_size`` = gpus_per_node * nodes."""

    device: str  # "cuda" | "cpu"
    gpus_per_node: int
    nodes: int = 1
    gpu_memory_gib: float = 0.0
    gpu_name: str | None = None
    bf16: bool = False
    fp16: bool = False
    intra_node_gbps: float | None = None  # GB/s per device inside a node, None = unknown
    inter_node_gbps: float | None = None  # GB/s per device across nodes, None = unknown
    peak_tflops: float | None = None  # dense per device, when known: bf16 on a GPU, fp32 (measured) per CPU rank
    host_memory_gib: float | None = None  # RAM per node for CPU offload; None = unknown
    memory_gbps: float | None = None  # device memory bandwidth, when known
    liger_kernel: bool = False  # liger-kernel importable where the run happens (it needs CUDA + Triton)
    nvme_gbps: float | None = None  # aggregate NVMe bandwidth per node for ZeRO-Infinity; None = no NVMe offload

    # assumed host RAM when unknown: 2x the node's GPU memory (a DGX H100 has 2 TiB for 640 GB of HBM)
    HOST_TO_GPU_MEMORY = 2.0

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"Hardware.device must be 'cuda' or 'cpu', got {self.device!r}")
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Hardware.{name} must be a positive int, got {value!r}")
        from hf_dist.validation import check_number

        check_number("Hardware.gpu_memory_gib", self.gpu_memory_gib, above=0, hint="Pass --gpu-memory GIB, e.g. 80.")
        for name, flag in (("host_memory_gib", "--host-memory GIB"), ("intra_node_gbps", None),
                           ("inter_node_gbps", None), ("peak_tflops", None), ("nvme_gbps", "--nvme-gbps GBPS")):  # fmt: skip
            if getattr(self, name) is not None:
                check_number(f"Hardware.{name}", getattr(self, name), above=0, hint=f"Pass {flag}." if flag else "")

    @property
    def host_memory_limit_gib(self) -> float:
        """Host RAM per node available to offloaded states (assumed when not known)."""
        if self.host_memory_gib:
            return self.host_memory_gib
        return self.HOST_TO_GPU_MEMORY * self.gpu_memory_gib * self.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "world_size": self.world_size}


def peak_tflops_for(name: str | None) -> float | None:
    return _lookup(PEAK_BF16_TFLOPS, name)


def memory_gbps_for(name: str | None) -> float | None:
    return _lookup(PEAK_HBM_GBPS, name)


def _lookup(table: tuple[tuple[str, float], ...], name: str | None) -> float | None:
    if not name:
        return None
    for key, value in table:
        if key.lower() in name.lower():
            return value
    return None


@functools.lru_cache(maxsize=1)
def cpu_core_gflops() -> float:
    """One CPU core's dense fp32 matmul rate in GFLOP/s, measured once per process (:data:`CPU_PROBE_SIZE`)."""
    import time

    import torch

    n, threads = CPU_PROBE_SIZE, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up: the BLAS picks its kernel and touches its buffers
        fastest = float("inf")
        for _ in range(CPU_PROBE_RUNS):
            start = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / fastest / 1e9


def cpu_threads_per_rank(ranks_per_node: int, env: dict[str, str] | None = None) -> int:
    """Cores one CPU rank computes on: its share of the cores this process may use, at most ``OMP_NUM_THREADS``
    (torchrun sets 1 for several ranks per node unless the user set it)."""
    env = os.environ if env is None else env
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // ranks_per_node)
    omp = env.get("OMP_NUM_THREADS", "")
    return min(share, int(omp)) if omp.isdigit() and int(omp) > 0 else share


def cpu_rank_peak_tflops(ranks_per_node: int) -> float:
    """Dense fp32 TFLOP/s of one CPU rank: the measured per-core rate times the cores it computes on."""
    return cpu_core_gflops() * cpu_threads_per_rank(ranks_per_node) / 1e3


def liger_kernel_installed() -> bool:
    """True when the optional ``liger-kernel`` package is importable (``pip install hf_dist[liger]``)."""
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def nodes_from_env(env: dict[str, str] | None = None) -> int | None:
    """Node count from the launcher: NNODES, WORLD_SIZE / LOCAL_WORLD_SIZE (torchrun), SLURM_NNODES."""
    env = os.environ if env is None else env
    for key in ("NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(key, "").isdigit():
            return int(env[key])
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0 and int(world) % int(local) == 0:
        return int(world) // int(local)
    return None


# a CUDA or ROCm driver shows itself here on Linux; without any of them torch sees no GPU, so it is not imported
_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")


def _may_have_gpu() -> bool:
    """False only where torch certainly sees no GPU: Linux without an NVIDIA or AMD driver, and torch not imported."""
    if "torch" in sys.modules or not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(path) for path in _DRIVER_FILES)


def _detect_cuda() -> dict | None:
    if not _may_have_gpu():
        return None
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "device": "cuda",
        "gpus_per_node": torch.cuda.device_count(),
        "gpu_memory_gib": props.total_memory / 1024**3,
        "gpu_name": props.name,
        "host_memory_gib": _host_memory_gib(),
        "bf16": bool(torch.cuda.is_bf16_supported()),
        "fp16": True,
    }


def _host_memory_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / 1024**3


def _detect_cpu() -> dict:
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    procs = int(local) if local.isdigit() and int(local) > 0 else 1
    # CPU ranks share the host RAM; mixed precision is off on CPU (fp32 training)
    return {
        "device": "cpu",
        "gpus_per_node": procs,
        "gpu_memory_gib": _host_memory_gib(),  # divided by the process count below
        "gpu_name": None,
        "bf16": False,
        "fp16": False,
    }


def detect_hardware(
    *,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
    nodes: int | None = None,
    bf16: bool | None = None,
    gpu_name: str | None = None,
    host_memory_gib: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    liger_kernel: bool | None = None,
    nvme_gbps: float | None = None,
) -> Hardware:
    """Detect the local hardware; every argument given overrides what is detected.

    ``gpus`` is the TOTAL device count across ``nodes``. When ``gpu_memory_gib`` is given on a machine
    without CUDA, the result describes hypothetical CUDA GPUs (bf16 assumed unless ``bf16=False``), so
    a cluster can be planned from a laptop; without it, ``gpus`` counts CPU processes sharing host RAM.
    bf16 on CPU is allowed (torch supports it); on a CUDA GPU without bf16 it is an error.
    ``liger_kernel``: whether Liger kernels can be used there (default: CUDA GPUs, real or described,
    with the package installed here; pass True to plan for a cluster that has it).
    ``nvme_gbps``: aggregate bandwidth of each node's local NVMe drives (about 3 GB/s per PCIe 4.0 drive under
    mixed reads and writes); given, the planner may offload to NVMe (ZeRO-Infinity) when host RAM is too small.
    """
    _check_optional_positive("gpus", gpus, int)
    _check_optional_positive("nodes", nodes, int)
    _check_optional_positive("gpu_memory_gib", gpu_memory_gib, (int, float))
    detected, hypothetical = _detected(gpu_memory_gib, gpu_name)
    nodes = nodes or nodes_from_env() or 1
    if gpus is not None:
        if gpus % nodes:
            raise ValueError(
                f"gpus ({gpus}) is not divisible by nodes ({nodes}); every node needs the same number of GPUs, "
                f"e.g. gpus={nodes * max(1, gpus // nodes)}"
            )
        detected["gpus_per_node"] = gpus // nodes
    if bf16 is True and not detected["bf16"] and detected["device"] == "cuda" and not hypothetical:
        where = detected.get("gpu_name") or "this GPU"
        raise ValueError(f"bf16 was requested but {where} does not support it; use fp16 (bf16=False) instead")
    _override(detected, bf16=bf16, gpu_name=gpu_name, host_memory_gib=host_memory_gib, gpu_memory_gib=gpu_memory_gib)
    if liger_kernel is None:
        liger_kernel = detected["device"] == "cuda" and liger_kernel_installed()
    return Hardware(
        nodes=nodes,
        intra_node_gbps=intra_node_gbps,
        inter_node_gbps=inter_node_gbps,
        peak_tflops=_peak_tflops(detected),
        memory_gbps=memory_gbps_for(detected.get("gpu_name")),
        liger_kernel=bool(liger_kernel),
        nvme_gbps=nvme_gbps,
        **detected,
    )


def _peak_tflops(detected: dict) -> float | None:
    """A GPU's datasheet peak (by name); for CPU ranks, the measured rate of the cores each rank gets."""
    if detected["device"] == "cpu":
        return cpu_rank_peak_tflops(detected["gpus_per_node"])
    return peak_tflops_for(detected.get("gpu_name"))


def _detected(gpu_memory_gib: float | None, gpu_name: str | None) -> tuple[dict, bool]:
    """What this machine has: its CUDA GPUs, else its CPU; a GPU memory given on a machine without CUDA describes
    hypothetical CUDA GPUs (the second value says so)."""
    detected = _detect_cuda()
    hypothetical = detected is None and gpu_memory_gib is not None
    if detected is None:
        detected = _detect_cpu()
        if hypothetical:
            detected.update(device="cuda", bf16=True, fp16=True, gpu_name=gpu_name, host_memory_gib=None)
    return detected, hypothetical


def _override(detected: dict, *, bf16, gpu_name, host_memory_gib, gpu_memory_gib) -> None:
    """The values the caller gave over the detected ones; a CPU's memory is shared by the processes on it."""
    if bf16 is not None:
        detected["bf16"] = bf16
    if gpu_memory_gib is not None:
        detected["gpu_memory_gib"] = float(gpu_memory_gib)
    elif detected["device"] == "cpu":
        detected["gpu_memory_gib"] /= detected["gpus_per_node"]
    if gpu_name is not None:
        detected["gpu_name"] = gpu_name
    if host_memory_gib is not None:
        detected["host_memory_gib"] = float(host_memory_gib)


def _check_optional_positive(name: str, value, types) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, types) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
