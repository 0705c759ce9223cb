"""The traced allocation sequence and its replay through the caching allocator (hf_dist.tracing.allocations)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from hf_dist.planning.memory import estimate_memory
from hf_dist.tracing import trace_memory
from hf_dist.tracing.allocations import AllocationLog, on_stream
from tests.unit.marks import needs_traced_deepspeed

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


def test_a_restart_keeps_what_is_alive_as_the_set_up():
    """DeepSpeed's start (hf_dist.tracing.trace._Run._start_deepspeed): the storages alive after it are the replay's
    set-up, its transients are forgotten, and a storage freed later is freed under its new key."""
    log = AllocationLog()
    module, transient, flat = storage(30 * MIB), storage(60 * MIB), storage(30 * MIB)
    for made in (module, transient, flat):
        log.record(update("ADD"), made, False)
    log.record(update("DEL"), transient, False)
    log.restart([module, flat])
    assert [n for _, n in log.setup] == [30 * MIB, 30 * MIB] and not log.step and not log.state
    log.phase("forward")
    log.record(update("DEL"), module, False)  # ZeRO frees the module's own copy once it is flattened
    assert log.step == [(module._hf_dist_key, None)] and module._hf_dist_key == log.setup[0][0]


def test_a_storage_made_on_a_stream_is_logged_with_it_and_keeps_it_across_a_restart():
    log = AllocationLog()
    weight, bucket = storage(30 * MIB), storage(10 * MIB)
    log.record(update("ADD"), weight, False)
    with on_stream("reduction"):
        log.record(update("ADD"), bucket, False)  # made at the engine's start, on the reduction stream
    log.restart([weight, bucket])
    assert log.streams == {bucket._hf_dist_key: "reduction"}
    log.phase("forward")
    with on_stream("reduction"):
        flat = storage(40 * MIB)
        log.record(update("ADD"), flat, False)
    log.record(update("DEL"), flat, False)  # freed on whichever stream: its block goes back to the reduction pool
    activation = storage(40 * MIB)
    log.record(update("ADD"), activation, False)
    assert log.streams[flat._hf_dist_key] == "reduction" and activation._hf_dist_key not in log.streams
    allocator = log.replay()
    # the activation cannot take the flatten's freed block: a segment of its own on the default stream
    assert allocator.by_stream == {None: 30 * MIB + 40 * MIB, "reduction": 10 * MIB + 40 * MIB}


@needs_traced_deepspeed
def test_a_zero2_trace_tags_its_reduction_streams_storages_and_adds_no_comm_reserve(monkeypatch):
    """DeepSpeed 0.19.8's ZeRO-2 builds its fp32 gradient partition, flattens its buckets and upcasts inside
    ``with get_accelerator().stream(self.reduction_stream)`` (stage_1_and_2.py ``average_tensor``); the trace names
    the stream (tracing/zero_shims.py) and logs those storages on it."""
    pytest.importorskip("deepspeed")
    logs = []
    replay = AllocationLog.replay
    monkeypatch.setattr(AllocationLog, "replay", lambda self: logs.append(self) or replay(self))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    result = trace_memory(config, isolate=False, strategy="zero2", world_size=8, seq_len=64, micro_batch_size=2)
    assert result.streams == ["DeepSpeedZeroOptimizer.reduction_stream"]
    (log,) = logs
    tagged = {key for key, nbytes in log.step if nbytes is not None and key in log.streams}
    assert tagged and set(log.streams.values()) == {"ZeRO reduction"}
    freed = {key for key, nbytes in log.step if nbytes is None}
    assert tagged <= freed  # flattens, upcasts and the gradient partition: all freed within the step
    assert log.replay().by_stream["ZeRO reduction"] > 0
    estimate = estimate_memory(config, "zero2", 8, seq_len=64, micro_batch_size=2)
    assert estimate.comm_reserve > 0
    assert result.device_total(estimate) == result.reserved_bytes + estimate.overhead
    assert type(result).from_dict(result.to_dict()).streams == result.streams


@needs_traced_deepspeed
def test_a_zero_trace_replays_its_reserve_and_names_its_engine():
    pytest.importorskip("deepspeed")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    result = trace_memory(config, isolate=False, strategy="zero3", world_size=8, seq_len=64, micro_batch_size=2)
    assert result.reserved_bytes >= result.peak_bytes > 0 and result.engine.startswith("DeepSpeed 0.")
    again = type(result).from_dict(result.to_dict())
    assert (again.reserved_bytes, again.engine) == (result.reserved_bytes, result.engine)


def test_a_trace_reports_the_replayed_reserve_and_its_device_total_uses_it():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    result = trace_memory(config, isolate=False, strategy="ddp", seq_len=64, micro_batch_size=2)
    assert result.reserved_bytes >= result.peak_bytes > 0
    assert result.reserved_bytes % (2 * MIB) == 0  # whole segments: every request of this model is a small one
    estimate = estimate_memory(config, "ddp", 1, seq_len=64, micro_batch_size=2)
    assert result.device_total(estimate) == result.reserved_bytes + estimate.comm_reserve + estimate.overhead
    assert type(result).from_dict(result.to_dict()).reserved_bytes == result.reserved_bytes


def test_the_replay_gives_the_h100s_reserve_on_a_checkpointed_run():
    """Llama-3.2-1B full fine-tuning, DDP, micro-batch 4, checkpointing, fp32 weights on one H100: the first step's
    Adam state takes the blocks its fp32 logits freed, so the next steps allocate the logits anew; measured
    ``max_memory_reserved - max_memory_allocated`` = 6.62 GiB (benchmarks/data/gpu). ~20 s on 2 cores."""
    import importlib.util

    from hf_dist.testing import REPO_ROOT

    path = REPO_ROOT / "benchmarks" / "gpu_ground_truth.py"
    spec = importlib.util.spec_from_file_location("gpu_ground_truth", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    env, case, config_dir = next(
        (e, c, d)
        for e, c, d in bench.load([str(REPO_ROOT / "benchmarks/data/gpu/h100-llama-3.2-1b.json")])
        if c["activation_checkpointing"] and c["weights_loaded_as"] == "float32" and c["micro_batch_size"] == 4
    )
    result = trace_memory(str(config_dir / "config.json"), isolate=False, **bench.case_setup(case).to_dict())
    measured = case["measured"]
    replayed = (result.reserved_bytes - result.peak_bytes) / 1024**3
    assert replayed == pytest.approx(
        measured["max_memory_reserved_gib"] - measured["max_memory_allocated_gib"], rel=0.05
    )
    total = result.device_total(bench.predict(case, config_dir)) / 1024**3
    assert total == pytest.approx(measured["device_used_gib"], rel=0.01)
