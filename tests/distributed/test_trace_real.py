"""The tracer against real CPU allocation on 2 gloo ranks: the same preparation and steps, run on real tensors
(real DDP Reducer, real FSDP2 collectives, the real DeepSpeed engine), measured by torch's profiler; rank 0's peak
must equal the trace's.

Measured (torch 2.13 CPU): DDP, FSDP2 with accumulation and LoRA with dropout agree to the byte or within 112 bytes of
~2-3 MB; with activation checkpointing the trace is above the real peak by 0.4 % (full; 1.2 % on a CPU with AMX) and 0.3
% (LoRA), what torch's MemTracker documents for recomputation in backward (its attribution during AC is approximate).
LoRA was 2.7 % above while the trace ran a first step for the optimizer state: 32 KB of it stayed counted into the
measured step (the real peak is the same either way). DeepSpeed 0.19.8 (bf16, the Trainer's fused AdamW): ZeRO-1/2/3
full fine-tuning to the byte, ZeRO-1/3 LoRA within 112 bytes, ZeRO-2 LoRA ~30 KB below the real peak (of 2.0 GB, 1.4 MB
besides the reduce buckets): the real run's end-of-backward all-reduce of its bf16 bucket over gloo holds more than the
fake group's."""

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
# (32,896 bytes: half of the 256 x 64 fp32 embedding, + 128), freed by gloo's reduce-scatter work in another order.
# DDP with activation checkpointing: on a CPU with AMX (torch's bf16 CPU flash attention then packs its blocks with
# VNNI, another kernel path) the real peak is 1.2 % below the trace (2,527,584 vs 2,558,368 bytes), 0.4 % elsewhere
TOLERANCE = {"ddp_ckpt": 0.015, "ddp_lora_ckpt": 0.01, "fsdp_full_shard_accumulation": 0.02}


# DeepSpeed ZeRO-1/2/3 as hf_dist configures it (bf16: the engine casts the module, ZeRO-1 runs BF16_Optimizer)
DEEPSPEED = {f"zero{stage}{suffix}": TraceSetup(strategy=f"zero{stage}", method=method, **SHAPE)
             for stage in (1, 2, 3) for suffix, method in (("", "full"), ("_lora", "lora"))}  # fmt: skip
DEEPSPEED_TOLERANCE = 0.01
# the reduce buckets DeepSpeed allocates whatever the model (reduce_bucket_size bf16 elements: two with ZeRO-2's
# overlap_comm, one from ZeRO-3's start): the tolerance is also held on what remains, which the model decides
BUCKETS = {1: 0, 2: 2 * int(5e8) * 2, 3: int(5e8) * 2}
REST_TOLERANCE = 0.03


def _launch(tmp_path_factory, name: str, setups: dict[str, TraceSetup]) -> dict[str, int]:
    out = tmp_path_factory.mktemp(name) / "peaks.json"
    torchrun(
        SCRIPTS / "trace_real.py",
        [out, *[json.dumps(s.to_dict()) for s in setups.values()]],
        env={"OMP_NUM_THREADS": "1"},
        timeout=LAUNCH_TIMEOUT_S,
        outputs=[out],
    )
    return dict(zip(setups, json.loads(out.read_text()), strict=True))


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, int]:
    """Every setup's real peak, the torch layouts' and DeepSpeed's, in one launch."""
    return _launch(tmp_path_factory, "trace_real", {**SETUPS, **DEEPSPEED})


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_traced_peak_equals_the_real_one(name, measured):
    traced = trace_memory(tiny_llama_config(), isolate=False, **SETUPS[name].to_dict())
    real = measured[name]
    assert abs(traced.peak_bytes / real - 1) <= TOLERANCE.get(name, 0.001), (name, traced.peak_bytes, real)


@pytest.mark.parametrize("name", sorted(DEEPSPEED))
def test_traced_deepspeed_peak_equals_the_real_engines(name, measured):
    setup = DEEPSPEED[name]
    traced = trace_memory(tiny_llama_config(), isolate=False, **setup.to_dict()).peak_bytes
    real = measured[name]
    buckets = BUCKETS[setup.layout.strategy.zero_stage]
    assert abs(traced / real - 1) <= DEEPSPEED_TOLERANCE, (name, traced, real)
    assert abs((traced - buckets) / (real - buckets) - 1) <= REST_TOLERANCE, (name, traced, real)
