"""Each callback with a real single-process Trainer on a tiny Llama (CPU)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

import hf_dist
from hf_dist.callbacks import (
    ExportCallback,
    MemoryCallback,
    NanGuardCallback,
    PlanCallback,
    ProfilerCallback,
    ThroughputCallback,
    attach,
    default,
)
from hf_dist.callbacks.plan import PlanMismatchError, mismatch_error, plan_mismatches
from hf_dist.callbacks.profiler import comm_time_us
from hf_dist.callbacks.resume import CompleteCheckpointCallback, ShardedResumeCallback, ZeroInfinityResumeCallback
from hf_dist.testing import tiny_llama_config

TOKENS_PER_STEP = 2 * 16  # batch 2 x 16 tokens


@pytest.fixture(scope="module")
def tiny_plan():
    return hf_dist.plan(
        tiny_llama_config(), gpus=1, gpu_memory_gib=8, seq_len=16, micro_batch_size=2, global_batch_size=2
    )


def logged_steps(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_plan_callback_refuses_a_run_that_is_not_the_plan(make_trainer, tiny_plan, capsys, caplog):
    # The plan assumed a bf16 GPU; this CPU run is fp32 DDP on 1 process, and checkpoints although not planned.
    trainer = make_trainer([PlanCallback(tiny_plan)], max_steps=1, gradient_checkpointing=True)
    with pytest.raises(PlanMismatchError, match=r"(?s)mixed precision: planned bf16, running no\n    fix: pass auto_args' "
                       r"bf16 / fp16.*activation checkpointing: planned False, running True"):  # fmt: skip
        trainer.train()
    assert trainer.state.global_step == 0  # refused before the first step
    cb = PlanCallback(tiny_plan, strict=False)  # warns instead
    with caplog.at_level(logging.WARNING):
        make_trainer([cb], max_steps=1).train()
    assert "hf_dist plan:" in capsys.readouterr().out
    assert cb.mismatches == ["mixed precision: planned bf16, running no"]
    assert "differs from the plan: mixed precision" in caplog.text
    with pytest.raises(ValueError, match="needs an hf_dist.Plan"):
        PlanCallback(None)


def test_plan_mismatches_cover_every_planned_value(tiny_plan):
    live = {"strategy": "ddp", "world_size": 8, "mixed_precision": "bf16", "wrap_classes": ["LlamaMLP"],
            "micro_batch_size": 4, "gradient_accumulation_steps": 3, "activation_checkpointing": True,
            "tp_size": 2, "cp_size": 1, "sp_size": 1, "optimizer": "sgd", "max_length": 1024}  # fmt: skip
    fsdp = dataclasses.replace(tiny_plan, layout=dataclasses.replace(tiny_plan.layout, strategy="fsdp_full_shard"))
    got = plan_mismatches(fsdp, live, planned_wrap=["LlamaDecoderLayer"])
    assert got == [
        "strategy: planned fsdp_full_shard, running ddp",
        "world size: planned 1, running 8",
        "activation checkpointing: planned False, running True",
        "micro-batch: planned 2, running 4",
        "gradient accumulation: planned 1, running 3",
        "tp / cp / sp: planned (1, 1, 1), running (2, 1, 1)",
        "optimizer: planned adamw, running sgd",
        "sequence length: planned 16, running 1024",
        "FSDP wrap classes: planned ['LlamaDecoderLayer'], running ['LlamaMLP']",
    ]
    assert all("fix: " in line for line in str(mismatch_error(got)).splitlines()[2::2])


def test_a_launch_of_ranks_that_train_alone_is_refused(make_trainer, monkeypatch):
    """torchrun / accelerate launch on a machine without CUDA and without use_cpu: WORLD_SIZE=2, Trainer world 1."""
    trainer = make_trainer(max_steps=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanMismatchError, match=r"(?s)2 processes were launched \(WORLD_SIZE=2\) but the Trainer trains "
                       r"each as a single process.*use_cpu=True.*ACCELERATE_USE_CPU=1 torchrun"):  # fmt: skip
        attach(trainer)


def test_memory_and_throughput_reach_every_logging_backend(make_trainer, tiny_plan):
    trainer = make_trainer(max_steps=3)
    cbs = attach(
        trainer, [MemoryCallback(tiny_plan), ThroughputCallback(tiny_plan, peak_tflops=1.0, baseline_tokens_per_s=1e3)]
    )
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    # Inserted before the console printer (and any report_to integration), after the flow callback.
    assert names.index("MemoryCallback") == names.index("DefaultFlowCallback") + 1
    assert names.index("MemoryCallback") < names.index("PrinterCallback")
    trainer.train()
    steps = logged_steps(trainer)
    assert len(steps) == 3
    for entry in steps:
        assert entry["memory/peak_gib/rank_0"] == entry["memory/peak_gib_max"] > 0
        assert entry["memory/predicted_gib"] == round(tiny_plan.memory.total / 1024**3, 6)
        assert entry["memory/predicted/activations_gib"] == round(tiny_plan.memory.activations / 1024**3, 6)
        assert entry["memory/predicted/logits_gib"] == round(tiny_plan.memory.logits / 1024**3, 6)
        tps, step_time = entry["perf/tokens_per_s"], entry["perf/step_time_s"]
        assert tps * step_time == pytest.approx(TOKENS_PER_STEP, rel=0.01)
        fpt = hf_dist.planning.flops.flops_per_token_from_spec(tiny_plan.model, 16)
        assert entry["perf/mfu"] == pytest.approx(tps * fpt / 1e12, rel=0.01, abs=1e-5)
        assert entry["perf/scaling_efficiency"] == pytest.approx(tps / 1e3, rel=0.01)
    assert cbs[1]._handle is None  # the token-counting hook is removed at train end
    # time to max_steps at the mean step time so far: two steps left after the first, none after the last
    assert steps[0]["perf/eta_s"] == pytest.approx(2 * steps[0]["perf/step_time_s"], abs=0.1)
    assert steps[-1]["perf/eta_s"] == 0


def _nan_loss_from(model, first_bad_step: int, last_bad_step: int = 10**9):
    calls = {"n": 0}

    def hook(module, args, kwargs, output):
        calls["n"] += 1  # one forward per optimizer step here (no accumulation)
        if module.training and first_bad_step <= calls["n"] <= last_bad_step:
            output.loss = output.loss * float("nan")
        return output

    model.register_forward_hook(hook, with_kwargs=True)


def test_nan_guard_skips_bad_updates_and_keeps_training(make_trainer):
    from transformers import LlamaForCausalLM, TrainerCallback

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    _nan_loss_from(model, 3, 4)
    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = [p.detach().clone() for p in model.parameters()]

    guard = NanGuardCallback(patience=3)
    trainer = make_trainer([guard, Snapshot()], model=model, max_steps=6)
    trainer.train()
    assert guard.bad_steps == [3, 4] and guard.skipped_steps == [3, 4] and guard.stopped_at is None
    assert trainer.state.global_step == 6
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[4], strict=True))  # steps 3-4 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[4], snapshots[5], strict=True))  # step 5 trained again
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_guard_stops_after_patience_with_advice(make_trainer, caplog):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    _nan_loss_from(model, 2)
    guard = NanGuardCallback(patience=2)
    with caplog.at_level(logging.ERROR):
        trainer = make_trainer([guard], model=model, max_steps=8)
        trainer.train()
    assert guard.stopped_at == 3 and trainer.state.global_step == 3
    assert "steps 2..3" in caplog.text and "lower the learning rate" in caplog.text and "bf16" in caplog.text
    with pytest.raises(ValueError, match="patience must be an int >= 1"):
        NanGuardCallback(patience=0)


def test_export_writes_a_loadable_hf_folder(make_trainer, tmp_path):
    from transformers import LlamaForCausalLM

    trainer = make_trainer([ExportCallback()], max_steps=2)
    trainer.train()
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "out" / "hf_model")
    expected, got = trainer.model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    with pytest.raises(ValueError, match="not starting with 'checkpoint-'"):
        ExportCallback(name="checkpoint-final")


def test_export_writes_a_peft_adapter(make_trainer, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    model = peft.get_peft_model(
        LlamaForCausalLM(tiny_llama_config()), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    make_trainer([ExportCallback()], model=model, max_steps=1).train()
    files = {p.name for p in (tmp_path / "out" / "hf_model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files


def test_profiler_writes_trace_for_the_window(make_trainer, tmp_path):
    prof = ProfilerCallback(start_step=1, num_steps=2)
    make_trainer([prof], max_steps=4).train()
    assert prof.trace_path and prof.trace_path.endswith(".pt.trace.json")
    assert prof.comm_share == 0.0  # one process: nothing to communicate


def test_comm_time_counts_collectives_only():
    class Event:
        def __init__(self, key, cpu):
            self.key, self.self_cpu_time_total, self.self_device_time_total = key, cpu, 0

    events = [Event("gloo:all_reduce", 30.0), Event("c10d::allreduce_", 5.0), Event("aten::mm", 100.0)]
    assert comm_time_us(events) == 35.0


def test_attach_replays_init_end_for_late_callbacks(make_trainer):
    trainer = make_trainer()
    seen = []

    class Recorder(TrainerCallback):
        def on_init_end(self, args, state, control, model=None, **kwargs):
            seen.append(model)

    attach(trainer, [Recorder()])
    assert seen == [trainer.model]


def test_default_set(tiny_plan):
    kinds = [type(c) for c in default()]
    assert kinds[:6] == [
        ShardedResumeCallback, ZeroInfinityResumeCallback, CompleteCheckpointCallback, NanGuardCallback,
        ThroughputCallback, MemoryCallback,
    ]  # fmt: skip  # the optimizer shards are written before the marker lists the files
    assert [k.__name__ for k in kinds[6:]] == ["HangWatchdogCallback", "ReshardCallback"]
    with_plan = default(tiny_plan)
    assert isinstance(with_plan[0], PlanCallback) and with_plan[-3].plan is tiny_plan


# --- CUDA code paths, with torch.cuda's statistics replaced (no GPU on this machine or in CI) ---


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda reporting one initialized device whose peaks are 3 GiB allocated / 4 GiB reserved."""
    from hf_dist.callbacks.memory import GIB

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 4 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (75 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    return calls


def test_memory_callback_reports_cuda_peaks_and_resets_them(fake_cuda):
    callback = MemoryCallback()
    callback.on_train_begin(None, None, None)
    assert fake_cuda == ["reset"]  # peaks count from the first step, not from model loading
    model = torch.nn.Linear(4, 4)
    figures = callback.measure(model)
    assert figures["peak_gib"] == 3.0 and figures["reserved_gib"] == 4.0
    assert figures["device_used_gib"] == 5.0  # total - free: the CUDA context and the allocator's reserve included
    assert figures["model_states_gib"] == pytest.approx((16 + 4) * 4 / 1024**3)
    assert fake_cuda == ["reset", "reset"]  # each log reports the peak since the previous one


def test_profiler_records_cuda_and_counts_device_time(fake_cuda, monkeypatch, tmp_path):
    import types

    import hf_dist.callbacks.profiler as profiler_module

    class Event:
        def __init__(self, key, cpu, device):
            self.key, self.self_cpu_time_total, self.self_device_time_total = key, cpu, device

    class FakeProfile:
        def __init__(self, activities, record_shapes):
            self.activities = activities
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, path):
            Path(path).write_text("{}")

        def key_averages(self):
            return [Event("ncclDevKernel_AllReduce_Sum_f32", 10.0, 2_000.0), Event("aten::mm", 50.0, 9_000.0)]

    made: list[FakeProfile] = []
    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    clock = [100.0, 100.01]  # a 10 ms window
    monkeypatch.setattr(profiler_module.time, "perf_counter", lambda: clock.pop(0) if len(clock) > 1 else clock[0])
    callback = ProfilerCallback(start_step=0, num_steps=1, output_dir=str(tmp_path))
    args = types.SimpleNamespace(process_index=0, output_dir=str(tmp_path))
    callback.on_step_begin(args, types.SimpleNamespace(global_step=0), None)
    callback.on_step_end(args, types.SimpleNamespace(global_step=1), None)
    assert torch.profiler.ProfilerActivity.CUDA in made[0].activities
    assert "sync" in fake_cuda  # kernels finished before the window closed
    assert callback.comm_share == pytest.approx(2_000.0 / 10_000.0)  # NCCL kernel device time / wall time


def test_eta_uses_the_mean_measured_step_time_and_compares_speed_with_the_plan():
    from types import SimpleNamespace

    cb = ThroughputCallback(SimpleNamespace(tokens_per_s=1000.0, hardware=None))
    state = SimpleNamespace(max_steps=100, global_step=10)
    assert cb._eta(state, elapsed=30.0, steps=10, slots_per_s=500.0) == {
        "perf/eta_s": 270.0,  # 90 steps left at 3 s each
        "perf/tokens_per_s_vs_plan": 0.5,
    }
    state.global_step = 20
    assert cb._eta(state, elapsed=10.0, steps=10, slots_per_s=1000.0)["perf/eta_s"] == 160.0  # 80 x (40 s / 20)
    assert "perf/eta_s" not in cb._eta(SimpleNamespace(max_steps=-1, global_step=1), 1.0, 1, 1.0)
