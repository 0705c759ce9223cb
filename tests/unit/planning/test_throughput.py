"""The step-time model's terms (hf_dist.planning.throughput, hf_dist.planning.flops) against hand-computed numbers."""

from __future__ import annotations

import pytest

from hf_dist.planning.flops import attention_flops_per_token, matmul_flops_per_token
from hf_dist.planning.hardware import Hardware
from hf_dist.planning.modelinfo import ModelSpec
from hf_dist.planning.throughput import (
    FLASH_EFFICIENCY_HOPPER,
    FLASH_EFFICIENCY_OTHER,
    GEMM_EFFICIENCY,
    compute_seconds_per_token,
    flash_efficiency,
    optimizer_step_bytes,
)

H100 = Hardware(device="cuda", gpus_per_node=1, gpu_memory_gib=80, gpu_name="NVIDIA H100 80GB HBM3", peak_tflops=1.0)


def test_flash_attention_skips_the_masked_half_and_its_backward_is_five_matmuls():
    # 2 layers, query width 64, 7 keys: a causal query attends (7 + 1) / 2 = 4 keys on average
    forward = 4 * 64 * 4 * 2  # QK^T and AV, 2 FLOPs per multiply-add
    assert attention_flops_per_token(num_layers=2, query_width=64, keys=7) == forward + 2.5 * forward  # 7168
    assert attention_flops_per_token(num_layers=2, query_width=64, keys=7, recomputed=True) == 9216


def test_eager_attention_multiplies_the_whole_matrix_and_its_backward_is_four_matmuls():
    forward = 4 * 64 * 7 * 2
    assert attention_flops_per_token(num_layers=2, query_width=64, keys=7, flash=False) == 3 * forward  # 10752


def test_matmul_flops_count_what_autograd_computes():
    assert matmul_flops_per_token(matmul_params=100, trainable_matmul_params=100) == 600  # 6 per weight
    assert matmul_flops_per_token(matmul_params=102, trainable_matmul_params=2) == 412  # frozen base: 4 per weight
    # checkpointing recomputes the 80 weights of the decoder layers: +2 each, frozen or not
    assert matmul_flops_per_token(matmul_params=102, trainable_matmul_params=2, recomputed_matmul_params=80) == 572


def test_fused_adamw_with_gradient_clipping_moves_these_bytes():
    # fp32 weights, gradients and moments of 10 params: Adam reads w, g, m, v and writes w, m, v (2*40 + 40 + 2*80),
    # clipping reads the gradients for the norm and reads and writes them to scale (3*40)
    assert optimizer_step_bytes(40, 40, 80) == 280 + 120


@pytest.mark.parametrize(
    ("name", "expected"), [("NVIDIA H100 80GB HBM3", FLASH_EFFICIENCY_HOPPER), ("NVIDIA H200", FLASH_EFFICIENCY_HOPPER),
                           ("NVIDIA A100-SXM4-80GB", FLASH_EFFICIENCY_OTHER)],
)  # fmt: skip
def test_flash_efficiency_by_architecture(name, expected):
    assert flash_efficiency(Hardware(device="cuda", gpus_per_node=1, gpu_memory_gib=80, gpu_name=name)) == expected
    assert flash_efficiency(Hardware(device="cpu", gpus_per_node=1, gpu_memory_gib=8)) == GEMM_EFFICIENCY


def spec(**overrides) -> ModelSpec:
    kw = dict(num_params=1000, num_layers=2, hidden_size=8, num_attention_heads=2, head_dim=4, layer_params=400,
              embedding_params=100, intermediate_size=16, num_key_value_heads=2, vocab_size=12)  # fmt: skip
    return ModelSpec(**{**kw, **overrides})


def test_compute_seconds_of_full_fine_tuning_by_hand():
    # untied: the 100-parameter embedding is a lookup, 900 matmul weights, 800 of them in the decoder layers
    s = spec()
    attention = attention_flops_per_token(num_layers=2, query_width=8, keys=16)
    expected = 6 * 900 / GEMM_EFFICIENCY / 1e12 + attention / FLASH_EFFICIENCY_HOPPER / 1e12
    assert compute_seconds_per_token(s, 1000, 16, False, H100) == pytest.approx(expected)
    recomputed = attention_flops_per_token(num_layers=2, query_width=8, keys=16, recomputed=True)
    ckpt = (6 * 900 + 2 * 800) / GEMM_EFFICIENCY / 1e12 + recomputed / FLASH_EFFICIENCY_HOPPER / 1e12
    assert compute_seconds_per_token(s, 1000, 16, True, H100) == pytest.approx(ckpt)


def test_lora_recompute_costs_a_larger_share_than_full_fine_tunings():
    # a frozen base skips its weight gradients (4 of 6 FLOPs per weight) but checkpointing recomputes the layers' whole
    # forward (2 per weight): +2/4 of the base's work instead of +2/6 -- the recompute the old model scaled by 4/3
    s = spec(num_params=10_000, layer_params=4_900, embedding_params=100)  # mostly layers, as in a real model
    full = compute_seconds_per_token(s, 10_000, 1, True, H100) / compute_seconds_per_token(s, 10_000, 1, False, H100)
    lora = compute_seconds_per_token(s, 20, 1, True, H100) / compute_seconds_per_token(s, 20, 1, False, H100)
    assert full == pytest.approx((6 * 9_900 + 2 * 9_800) / (6 * 9_900), rel=0.01)
    assert lora == pytest.approx((4 * 9_920 + 2 * 20 + 2 * 9_820) / (4 * 9_920 + 2 * 20), rel=0.01)
    assert lora > 1 + 1 / 3 + 0.1 > full
