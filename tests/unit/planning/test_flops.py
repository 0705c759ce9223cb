from __future__ import annotations

import pytest

from hf_dist.planning.flops import flops_per_token_from_spec, mfu, scaling_efficiency, training_flops_per_token


def test_palm_formula_by_hand():
    # 6 * (1000 - 100) + 12 * 2 layers * 64 hidden * 128 seq = 5400 + 196608
    assert (
        training_flops_per_token(num_params=1000, num_layers=2, hidden_size=64, seq_len=128, embedding_params=100)
        == 202008
    )
    # Tied embeddings: the shared matrix is the LM head matmul, so it counts.
    got = training_flops_per_token(
        num_params=1000, num_layers=2, hidden_size=64, seq_len=128, embedding_params=100, tie_word_embeddings=True
    )
    assert got == 6000 + 196608


def test_llama_7b_order_of_magnitude():
    # Llama-2-7B: 6.74e9 params, 32 layers, 4096 hidden, 32000 x 4096 input embedding, seq 4096.
    fpt = training_flops_per_token(
        num_params=6_738_415_616, num_layers=32, hidden_size=4096, seq_len=4096, embedding_params=32000 * 4096
    )
    assert fpt == 6 * (6_738_415_616 - 131_072_000) + 12 * 32 * 4096 * 4096
    assert 4.6e10 < fpt < 4.7e10  # ~46 GFLOPs per token, the usual "6N + attention" figure


def test_mfu_and_scaling():
    assert mfu(1000.0, 1e9, 1e13) == pytest.approx(0.1)
    assert scaling_efficiency(180.0, 2, 100.0) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="peak_flops_per_second must be > 0"):
        mfu(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="embedding_params"):
        training_flops_per_token(num_params=10, num_layers=1, hidden_size=1, seq_len=1, embedding_params=20)


def test_from_spec():
    from hf_dist.planning.modelinfo import model_spec
    from hf_dist.testing import tiny_llama_config

    spec = model_spec(tiny_llama_config())
    fpt = flops_per_token_from_spec(spec, 16)
    assert fpt == 6 * (spec.num_params - spec.embedding_params) + 12 * 2 * 64 * 16
