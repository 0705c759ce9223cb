"""ZeRO-Infinity (DeepSpeed ZeRO-3 offload to NVMe): the settings hf_dist writes, and what they cost per rank.

Two figures, both per rank, from how DeepSpeed 0.19 swaps (``deepspeed/runtime/swap_tensor/``, ``zero/stage3.py``):

- :func:`host_bytes`: host RAM that NVMe offload still pins (:class:`~hf_dist.planning.memory_estimate.MemoryEstimate` ``cpu``);
- :func:`swap_files`: the swap files under ``nvme_path`` (``Plan.swap_bytes`` per node, and the disk-space check
  before training, :func:`hf_dist.runtime.support.check_nvme_offload`).

Measured on 2 CPU ranks (tests/distributed/test_nvme_offload.py): the optimizer's swap files hold exactly the fp32
master partition and the two Adam moments of every sub-group DeepSpeed swaps; its gradient files hold at most the
fp32 gradient partition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP32 = 4
# DeepSpeed's NVMe swap-buffer defaults (deepspeed/runtime/zero/offload_config.py)
NVME_OPTIMIZER_BUFFER_COUNT = 4
# ZeRO-Infinity swaps the optimizer one sub-group at a time through NVME_OPTIMIZER_BUFFER_COUNT pinned fp32 buffers
# of the largest sub-group: DeepSpeed's default sub_group_size (1e9 elements) pins 16 GB per rank; 1e8 pins 1.6 GB
# and still moves 400 MB per read, well above what an NVMe drive needs to reach its bandwidth.
NVME_SUB_GROUP_SIZE = 100_000_000
NVME_PARAM_BUFFER_COUNT = 5
NVME_PARAM_BUFFER_SIZE = 100_000_000  # elements per parameter swap buffer, at least (see param_buffer_elements)
NVME_PARAM_MAX_IN_CPU = 1_000_000_000  # 16-bit parameter elements DeepSpeed keeps in host memory next to NVMe
# A tensor smaller than this stays in host memory instead of a swap file (swap_tensor/utils.py MIN_AIO_BYTES, and
# the aio block size, which hf_dist writes as 1 MiB): a sub-group of a few norms, or a tiny model's partition.
MIN_SWAP_BYTES = 1024**2


@dataclass(frozen=True)
class SwapFiles:
    """Bytes per rank in ZeRO-Infinity's swap files under ``nvme_path/zero_stage_3/``.

    ``optimizer``: ``optimizer/rank*/`` master-weight and moment files (``<ids>.tensor.swp``, ``exp_avg-…``,
    ``exp_avg_sq-…``); ``gradients``: the fp32 gradient partitions written there during backward, one piece per
    parameter whose partition reaches :data:`MIN_SWAP_BYTES` (smaller ones stay in the host's gradient
    partition); ``params``: ``<dtype>params/rank*/``, each parameter partition that reaches it, written when ZeRO-3
    partitions the model (partition_parameters.py) and kept, also for the parameters then held in host memory
    under ``max_in_cpu``."""

    optimizer: int = 0
    gradients: int = 0
    params: int = 0

    @property
    def total(self) -> int:
        return self.optimizer + self.gradients + self.params


def swap_files(
    partition: int,
    state_bytes: int,
    master_bytes: int,
    param_bytes: int,
    params: bool,
    tensors: list[int] | None = None,
) -> SwapFiles:
    """:class:`SwapFiles` of one rank: ``partition`` trainable elements (the rank's share), ``state_bytes`` optimizer
    state per element, ``master_bytes`` per master weight (and gradient), ``param_bytes`` per element of the
    parameter swapper (its dtype), ``params``: the parameters are offloaded too (``optimizer+params``). ``tensors``:
    the rank's elements of each weight tensor when known; otherwise every gradient and parameter counts as swapped
    (an upper bound)."""

    def swapped(pieces: list[int], size: int) -> int:
        return sum(n for n in pieces if n * size >= MIN_SWAP_BYTES) * size

    pieces = [partition] if tensors is None else tensors
    if partition * master_bytes < MIN_SWAP_BYTES:  # the sub-group stays in memory, and its gradients with it
        return SwapFiles(params=swapped(pieces, param_bytes) if params else 0)
    optimizer = partition * (state_bytes + master_bytes)
    return SwapFiles(optimizer, swapped(pieces, master_bytes), swapped(pieces, param_bytes) if params else 0)


def host_bytes(
    partition: int,
    param_partition: int,
    compute: int,
    params: bool,
    buffer_bytes: int | None = None,
    buffer_elements: int = NVME_PARAM_BUFFER_SIZE,
) -> int:
    """Host RAM per rank that NVMe offload still pins (stage3.py, swap_tensor/): the fp32 gradient partition
    (``grad_partitions_flat_buffer`` is on the CPU whenever the optimizer is offloaded), the optimizer swapper's
    ``buffer_count`` fp32 buffers of the largest sub-group partition (optimizer_utils.py: a sub-group's master
    weights, two moments and gradient) and, with the parameters on NVMe, ``buffer_count`` parameter buffers of
    ``buffer_elements`` (:func:`param_buffer_elements`, partitioned_param_swapper.py) plus up to ``max_in_cpu`` 16-bit parameter elements
    kept in host memory (stage3.py ``param_groups_fp16_flat_cpu_memory``). The settings are the ones hf_dist's
    DeepSpeed JSON writes. ``buffer_bytes``: bytes per element of the parameter swapper's buffers
    (:func:`param_swapper_bytes`; default ``compute``)."""
    out = partition * FP32 + NVME_OPTIMIZER_BUFFER_COUNT * min(NVME_SUB_GROUP_SIZE, partition) * FP32
    if params:
        buffers = NVME_PARAM_BUFFER_COUNT * buffer_elements * (buffer_bytes or compute)
        out += buffers + min(NVME_PARAM_MAX_IN_CPU, param_partition) * compute
    return out


def param_swapper_bytes(device: str, compute: int) -> int:
    """Bytes per element of the parameter swapper's buffers and files: the compute dtype's, except on DeepSpeed's CPU
    accelerator without fp16 kernels, where ``zero.Init`` picks bf16 whatever the model's dtype
    (partition_parameters.py ``_set_dtype``: ``dtype or torch.float16 if fp16_supported else torch.bfloat16 ...``;
    a CPU plan is for the CPU it runs on, so that CPU is asked, as DeepSpeed asks it)."""
    return compute if device != "cpu" or _cpu_fp16_supported() else 2


def _cpu_fp16_supported() -> bool:
    """DeepSpeed's ``CPU_Accelerator.is_fp16_supported``: oneDNN's fp16 kernels on this CPU (AVX512-FP16 / AMX-FP16)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # DeepSpeed treats a failed probe as unsupported too
        return False


def param_buffer_elements(largest_partition: int) -> int:
    """``offload_param.buffer_size``: DeepSpeed swaps a parameter partition in through one buffer and asserts it fits
    (partitioned_param_swapper.py ``get_buffer``: "More elements ... than buffer size"), so the buffers must hold the
    largest partition, e.g. a 128k x 8k embedding over 8 ranks (1.3e8 elements) is over the 1e8 default."""
    return max(NVME_PARAM_BUFFER_SIZE, largest_partition)


def per_rank(count: float, degree: int) -> int:
    """A rank's share of ``count`` elements split over ``degree`` ranks (DeepSpeed pads the last partition)."""
    return math.ceil(count / degree)
