"""Host RAM at load (hf_dist.planning.load_memory) and the planner's refusal when loading cannot fit."""

from __future__ import annotations

import pytest

import hf_dist
from hf_dist.planning.dtypes import GIB
from hf_dist.planning.load_memory import LoadPath, load_memory
from hf_dist.testing import public_config

N = 70_000_000_000


def test_every_rank_holds_its_own_fp32_copy_and_the_node_shares_the_file_pages():
    load = load_memory(N, "fsdp_full_shard", held_bytes=4, checkpoint_bytes=2, ranks_per_node=8)
    assert load.path is LoadPath.EVERY_RANK
    assert load.per_node == 8 * 4 * N  # the "about 2 TB for 70B on 8 GPUs"
    assert load.rank_peak == 4 * N + 2 * N  # a rank's resident set also shows the file's pages it read
    assert load.text() == (
        "2086.2 GiB per node (every rank reads the weights: 8 ranks x 260.8 GiB fp32 copy; + 130.4 GiB of checkpoint "
        "pages in the page cache, which it can evict)"
    )


def test_a_load_in_the_checkpoint_dtype_is_only_evictable_file_pages():
    load = load_memory(N, "zero2", held_bytes=2, checkpoint_bytes=2, ranks_per_node=8)
    assert (load.copy_bytes, load.per_node, load.file_bytes) == (0, 0, 2 * N)
    assert load.text().startswith("no copy of the weights (every rank reads the weights; 130.4 GiB of checkpoint")


def test_zero3_reads_on_rank_0_only():
    load = load_memory(N, "zero3", held_bytes=4, checkpoint_bytes=2, ranks_per_node=8)
    assert load.path is LoadPath.RANK0_PARTITIONED and load.per_node == 0 and load.file_bytes == 2 * N


def test_a_tensor_parallel_rank_holds_its_slice():
    load = load_memory(N, "fsdp_full_shard", held_bytes=4, checkpoint_bytes=2, ranks_per_node=8, tp_size=4)
    assert load.per_node == 8 * (4 * N // 4)


def test_the_checkpoint_dtype_comes_from_the_config():
    config = public_config("llama-3-8b")
    assert hf_dist.model_spec(config).checkpoint_bytes == 2
    config.dtype = "float32"
    assert hf_dist.model_spec(config).checkpoint_bytes == 4


def test_the_planner_refuses_layouts_whose_load_does_not_fit_host_ram_with_the_arithmetic():
    plan = hf_dist.plan(public_config("llama-3-70b"), gpus=8, gpu_memory_gib=80, host_memory_gib=1536, seq_len=4096)
    refused = [c for c in plan.candidates if c.reason.startswith("loading needs")]
    assert {c.strategy for c in refused} >= {"ddp", "fsdp_full_shard"}
    assert all(not c.fits for c in refused)
    assert "loading needs 2102.7 GiB per node (every rank reads the weights: 8 ranks x 262.8 GiB fp32 copy;" in (
        refused[0].reason
    )
    assert "ZeRO-3 reads the weights on rank 0 only" in refused[0].reason
    assert plan.strategy == "zero3" and plan.load.per_node < 1536 * GIB
    assert "host RAM at load: no copy of the weights (rank 0 reads the weights" in plan.explain()


@pytest.mark.parametrize("host", [None, 4096])
def test_a_large_enough_host_refuses_no_layout_for_loading(host):
    plan = hf_dist.plan(public_config("llama-3-8b"), gpus=8, gpu_memory_gib=80, host_memory_gib=host, seq_len=4096)
    assert not [c for c in plan.candidates if c.reason.startswith("loading needs")]
    assert plan.to_dict()["load"]["path"] == "EVERY_RANK"
