"""The memory model of TRL's fused LM head (``trl_head_bytes``) against TRL's own kernel run on CPU."""

from __future__ import annotations

import pytest
import torch

from hf_dist.planning.dtypes import engine_dtypes
from hf_dist.planning.head_activations import trl_head_bytes
from hf_dist.planning.memory import estimate_memory
from hf_dist.planning.modelinfo import ModelSpec
from hf_dist.testing import memory_curve, public_config

H, V, TOKENS = 1024, 32768, 2  # few tokens: the CPU fold's tile-sized temporaries (absent on GPU) stay ~1 %


def _peak_of_head(hidden_size: int, vocab: int, tokens: int) -> int:
    """Live tensor bytes at the peak of TRL's head (the mask copy, forward, backward) above what existed before."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    torch.manual_seed(0)
    last_hidden = torch.randn(1, tokens + 1, hidden_size, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vocab, hidden_size) * 0.02)
    labels = torch.randint(0, vocab, (1, tokens + 1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        hidden, targets = last_hidden[:, :-1], labels[:, 1:]
        mask = targets != -100
        # what add_fused_lm_head passes: the valid positions (the compact path), log-probabilities only
        log_probs = ChunkedLogProbFunction.apply(
            hidden[mask], weight, None, targets[mask], 1.0, 32768, None, 1.0, ("log_probs",)
        )[0]
        (-log_probs.sum()).backward()
    curve, _ = memory_curve(prof)
    return max(live for _, live in curve)


def test_trl_head_peak_matches_its_kernel_on_cpu():
    pytest.importorskip("trl", reason="TRL is the [trl] extra; `make test` installs it")
    spec = ModelSpec(num_params=V * H, num_layers=1, hidden_size=H, vocab_size=V, layer_params=1)
    lay = engine_dtypes("ddp", 4, False)  # fp32, no autocast: the CPU kernel's dtypes
    norm = (4 + 4) * H * TOKENS  # the final norm's saved tensors: not part of this measurement
    modelled = trl_head_bytes(spec, TOKENS, lay, trains_head=True) - norm
    measured = _peak_of_head(H, V, TOKENS)
    assert measured == pytest.approx(modelled, rel=0.03), (measured, modelled)


def test_sft_trainers_head_is_far_smaller_than_full_logits_at_long_sequences():
    spec = public_config("llama-3-8b")
    kw = dict(seq_len=8192, activation_checkpointing=True)
    full = estimate_memory(spec, "fsdp_full_shard", 8, **kw)
    fused = estimate_memory(spec, "fsdp_full_shard", 8, fused_lm_head=True, **kw)
    # HF: three fp32 [tokens, vocab] tensors (12 x 8192 x 128256 bytes); TRL: an fp32 [vocab, hidden] weight gradient
    assert full.logits > 12 * 8192 * 128256
    assert fused.logits < 0.4 * full.logits
    assert fused.logits > 4 * 128256 * 4096  # the fp32 weight-gradient buffer
    # LoRA freezes the head: no weight gradient at all
    lora = estimate_memory(spec, "fsdp_full_shard", 8, method="lora", fused_lm_head=True, **kw)
    assert lora.logits < 4 * 128256 * 4096
