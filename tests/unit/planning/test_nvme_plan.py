"""NVMe offload (ZeRO-Infinity) pinned in the plan, and the swap files it counts (hf_dist/planning/nvme.py).

The files themselves are measured on 2 CPU ranks in tests/distributed/test_nvme_offload.py."""

from __future__ import annotations

import math

import pytest

from hf_dist.planning.hardware import Hardware
from hf_dist.planning.nvme import MIN_SWAP_BYTES, swap_files
from hf_dist.planning.planner import plan
from hf_dist.testing import tiny_llama_config

GPUS = Hardware(device="cuda", gpus_per_node=2, gpu_memory_gib=80.0, bf16=False)


def test_pinned_nvme_plans_zero3_and_counts_its_swap_files():
    config = tiny_llama_config(vocab_size=8192)
    p = plan(config, hardware=GPUS, offload="optimizer+params", offload_device="nvme", seq_len=32)
    assert (p.strategy, p.offload, p.offload_device) == ("zero3", "optimizer+params", "nvme")
    assert (p.tp_size, p.cp_size, p.sp_size) == (1, 1, 1)
    # fp32 master partition + two fp32 Adam moments per rank, and the fp32 gradients and (fp32, the compute dtype
    # here) parameters of the tensors whose partition reaches DeepSpeed's 1 MiB swap threshold: the embedding and the
    # head, 8192 x 64 / 2 ranks = 1 MiB each
    partition = math.ceil(p.num_params / 2)
    assert p.memory.swap == partition * (4 + 8) + 2 * 2**20 + 2 * 2**20
    assert p.swap_bytes == 2 * p.memory.swap
    text = p.explain()
    assert "offload=optimizer+params to NVMe (ZeRO-Infinity) as asked" in text
    assert "NVMe swap files: 20.8 MiB per node under nvme_path" in text


def test_nvme_offload_of_the_optimizer_only():
    p = plan(tiny_llama_config(vocab_size=8192), hardware=GPUS, offload="optimizer", offload_device="nvme", seq_len=32)
    assert (p.strategy, p.offload, p.layout.offload_device) == ("zero3", "optimizer", "nvme")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(strategy="zero2"), "offload_device='nvme' with strategy 'zero2': .* use strategy='zero3'"),
        (dict(strategy="zero1"), "ZeRO-1/2 and FSDP2 offload to CPU memory only"),
        (dict(strategy="fsdp_full_shard"), "offload_device='nvme' with strategy 'fsdp_full_shard'"),
        (dict(offload="none"), "needs offload 'optimizer' or 'optimizer\\+params', got offload none"),
        (dict(offload_device="disk"), "offload_device must be one of \\['cpu', 'nvme'\\] or None"),
    ],
)
def test_nvme_with_what_cannot_swap_is_refused(kwargs, match):
    kwargs = {"offload_device": "nvme", **kwargs}
    with pytest.raises(ValueError, match=match):
        plan(tiny_llama_config(), hardware=GPUS, **kwargs)


def test_offload_device_cpu_never_climbs_to_nvme():
    """A model that fits nowhere: with nvme_gbps NVMe is searched, with offload_device='cpu' it is not."""
    small = Hardware(device="cuda", gpus_per_node=1, gpu_memory_gib=10.3, host_memory_gib=8.5, nvme_gbps=3.0)
    config = tiny_llama_config(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, vocab_size=32000)
    searched = plan(config, hardware=small, seq_len=128, safety_margin=0.0)
    assert searched.offload_device == "nvme" and searched.swap_bytes > 0
    with pytest.raises(ValueError, match="nvme: not searched: offload_device='cpu' was asked for"):
        plan(config, hardware=small, seq_len=128, safety_margin=0.0, offload_device="cpu")


def test_swap_files_follow_deepspeed_thresholds():
    # a sub-group under DeepSpeed's 1 MiB minimum stays in host memory with its gradients: no optimizer files
    tiny = MIN_SWAP_BYTES // 4 - 1
    assert swap_files(tiny, 8, 4, 2, params=False).total == 0
    big = 10**9
    files = swap_files(big, 8, 4, 2, params=True)  # tensors unknown: every gradient and parameter (upper bound)
    assert (files.optimizer, files.gradients, files.params) == (12 * big, 4 * big, 2 * big)
    # known tensors: only those whose partition reaches 1 MiB are written (gradients in fp32, parameters in bf16)
    files = swap_files(big, 8, 4, 2, params=True, tensors=[big - 300_000, 300_000])
    assert (files.gradients, files.params) == (4 * big, 2 * (big - 300_000))
    assert swap_files(big, 8, 4, 2, params=False).params == 0


def test_parameter_buffers_hold_the_largest_partition(monkeypatch):
    """DeepSpeed swaps a parameter partition through one buffer and asserts it fits: Llama-3-70B's 128256 x 8192
    embedding over 8 ranks (1.31e8 elements) needs more than the 1e8 default; the host RAM counts the larger buffers."""
    from hf_dist.configs.deepspeed import deepspeed_config
    from hf_dist.planning import model_states as memory
    from hf_dist.planning.memory import estimate_memory
    from hf_dist.planning.model_states import nvme_param_buffer
    from hf_dist.planning.modelinfo import model_spec
    from hf_dist.planning.nvme import NVME_PARAM_BUFFER_COUNT, NVME_PARAM_BUFFER_SIZE
    from hf_dist.testing import public_config

    spec = model_spec(public_config("llama-3-70b"))
    assert nvme_param_buffer(spec, 8) == math.ceil(128256 * 8192 / 8)
    assert nvme_param_buffer(spec, 64) == NVME_PARAM_BUFFER_SIZE
    assert nvme_param_buffer(model_spec(7 * 10**9), 8) == NVME_PARAM_BUFFER_SIZE  # a bare count: the default
    cfg = deepspeed_config(
        "zero3", offload="optimizer+params", offload_device="nvme", nvme_path="/nvme", nvme_param_buffer=123
    )
    assert cfg["zero_optimization"]["offload_param"]["buffer_size"] == 123
    kw = dict(offload="optimizer+params", offload_device="nvme")
    sized = estimate_memory(spec, "zero3", 8, **kw).cpu
    monkeypatch.setattr(memory, "nvme_param_buffer", lambda spec, degree: NVME_PARAM_BUFFER_SIZE)
    default = estimate_memory(spec, "zero3", 8, **kw).cpu
    assert sized - default == NVME_PARAM_BUFFER_COUNT * (math.ceil(128256 * 8192 / 8) - NVME_PARAM_BUFFER_SIZE) * 2
