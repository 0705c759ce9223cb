"""The tracer against real CPU allocation on 2 gloo ranks: the same preparation and steps, run on real tensors
(real DDP Reducer, real FSDP2 collectives), measured by torch's profiler; rank 0's peak must equal the trace's.

Measured (torch 2.13 CPU): DDP, FSDP2 with accumulation and LoRA with dropout agree to the byte or within 112 bytes
of ~2-3 MB; with activation checkpointing the trace is above the real peak by 0.4 % (full) and 0.3 % (LoRA), what
torch's MemTracker documents for recomputation in backward (its attribution during AC is approximate). LoRA was 2.7 %
above while the trace ran a first step for the optimizer state: 32 KB of it stayed counted into the measured step
(the real peak is the same either way)."""

from __future__ import annotations

import json

import pytest

from hf_dist.testing import tiny_llama_config, torchrun
from hf_dist.tracing import TraceSetup, trace_memory
from tests.distributed.conftest import LAUNCH_TIMEOUT_S, SCRIPTS

pytestmark = pytest.mark.distributed

SHAPE = dict(world_size=2, seq_len=64, micro_batch_size=2, device="cpu")
SETUPS = {
    "ddp": TraceSetup(strategy="ddp", **SHAPE),
    "ddp_lora": TraceSetup(strategy="ddp", method="lora", **SHAPE),
    "fsdp_full_shard_accumulation": TraceSetup(strategy="fsdp_full_shard", gradient_accumulation_steps=2, **SHAPE),
    "ddp_ckpt": TraceSetup(strategy="ddp", activation_checkpointing=True, **SHAPE),
    "ddp_lora_ckpt": TraceSetup(strategy="ddp", method="lora", activation_checkpointing=True, **SHAPE),
}
# the others: 0.1 %. FSDP2 with accumulation: in 1 of ~10 CI runs the real peak held one more sharded root-unit buffer
# (32,896 bytes: half of the 256 x 64 fp32 embedding, + 128), freed by gloo's reduce-scatter work in another order
TOLERANCE = {"ddp_ckpt": 0.01, "ddp_lora_ckpt": 0.01, "fsdp_full_shard_accumulation": 0.02}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, int]:
    out = tmp_path_factory.mktemp("trace_real") / "peaks.json"
    setups = [json.dumps(s.to_dict()) for s in SETUPS.values()]
    torchrun(
        SCRIPTS / "trace_real.py",
        [out, *setups],
        env={"OMP_NUM_THREADS": "1"},
        timeout=LAUNCH_TIMEOUT_S,
        outputs=[out],
    )
    return dict(zip(SETUPS, json.loads(out.read_text()), strict=True))


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_traced_peak_equals_the_real_one(name, measured):
    traced = trace_memory(tiny_llama_config(), isolate=False, **SETUPS[name].to_dict())
    real = measured[name]
    assert abs(traced.peak_bytes / real - 1) <= TOLERANCE.get(name, 0.001), (name, traced.peak_bytes, real)
