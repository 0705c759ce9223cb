"""The traced allocation sequence and its replay through the caching allocator (hf_dist.tracing.allocations)."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import LlamaConfig

from hf_dist.planning.memory import estimate_memory
from hf_dist.tracing import trace_memory
from hf_dist.tracing.allocations import AllocationLog

MIB = 1024**2


def update(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name)  # MemTracker's _UpdateType members are read by name


def storage(nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(mem_consumed=nbytes)


def test_the_log_rebuilds_the_runs_history():
    log = AllocationLog()
    weight, state = storage(30 * MIB), storage(50 * MIB)
    log.record(update("ADD"), weight, False)  # the model, before the tracker's step
    log.record(update("ADD"), state, True)  # the optimizer state the trace made before the step
    log.phase("forward")
    activation = storage(100 * MIB)
    log.record(update("ADD"), activation, False)
    log.phase("backward")
    log.record(update("DEL"), activation, False)
    log.phase("optimizer step")
    log.phase("")
    assert [n for _, n in log.setup] == [30 * MIB]
    assert [n for _, n in log.state] == [50 * MIB]
    assert [n for _, n in log.step] == [100 * MIB, None] and log.optimizer_at == 2
    # the first step: 30 MiB of weights + a 100 MiB activation, then the state split off the freed block (50 + 50
    # cached); the second step's activation fits nowhere: a new segment; the third reuses it
    reserved, allocated = log.reserved_bytes()
    assert (reserved, allocated) == (230 * MIB, 180 * MIB)


def test_a_resized_storage_is_freed_and_made_again():
    log = AllocationLog()
    log.phase("forward")
    unsharded = storage(40 * MIB)
    log.record(update("ADD"), unsharded, False)
    unsharded.mem_consumed = 0
    log.record(update("SIZE"), unsharded, False)  # FSDP2's resize_(0) after the layer
    assert [n for _, n in log.step] == [40 * MIB, None, 0]


def test_a_trace_reports_the_replayed_reserve_and_its_device_total_uses_it():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    result = trace_memory(config, isolate=False, strategy="ddp", seq_len=64, micro_batch_size=2)
    assert result.reserved_bytes >= result.peak_bytes > 0
    assert result.reserved_bytes % (2 * MIB) == 0  # whole segments: every request of this model is a small one
    estimate = estimate_memory(config, "ddp", 1, seq_len=64, micro_batch_size=2)
    assert result.device_total(estimate) == result.reserved_bytes + estimate.comm_reserve + estimate.overhead
    assert type(result).from_dict(result.to_dict()).reserved_bytes == result.reserved_bytes

