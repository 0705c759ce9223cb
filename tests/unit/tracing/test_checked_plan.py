"""plan(verify=True): the chosen layout traced; a candidate whose trace does not fit is replaced by the next one."""

from __future__ import annotations

import dataclasses

import pytest

import hf_dist
import hf_dist.tracing.checked_plan as checked_plan
from hf_dist.cli.main import main
from hf_dist.planning.dtypes import GIB
from hf_dist.testing import public_config, tiny_llama_config
from hf_dist.tracing import TraceResult, TraceSetup
from tests.unit.marks import needs_traced_deepspeed


def test_verified_plan_carries_the_trace_of_its_choice():
    plan = hf_dist.plan(tiny_llama_config(), gpus=8, gpu_memory_gib=80, global_batch_size=16, verify=True)
    assert plan.trace is not None and plan.trace.setup.strategy == plan.strategy
    assert plan.trace.setup.micro_batch_size == plan.micro_batch_size
    assert plan.verification.startswith(f"traced {plan.strategy}")
    text = plan.explain()
    assert "traced rank 0 in" in text and "traced/modelled" in text
    assert plan.to_dict()["trace"]["peak_bytes"] == plan.trace.peak_bytes


@needs_traced_deepspeed
def test_a_zero3_pick_is_traced_and_says_in_one_line_what_ran():
    pytest.importorskip("deepspeed")
    plan = hf_dist.plan(tiny_llama_config(), gpus=8, gpu_memory_gib=80, strategy="zero3", global_batch_size=16,
                        verify=True)  # fmt: skip
    assert plan.strategy == "zero3" and plan.trace is not None and plan.trace.setup.strategy == "zero3"
    line = plan.verification
    assert "\n" not in line and line.startswith("traced zero3")
    assert "rank 0 of 8 ranks, DeepSpeed 0.19" in line and "engine under fake tensors" in line
    assert "allocated (modelled" in line
    note = " ".join(plan.trace.notes)
    assert "is_invalid_grad_norm" in note and "no overflow" in note  # what the shims answered
    assert "note: DeepSpeed's engine ran unchanged" in plan.explain()


def test_untraceable_choice_keeps_the_analytic_plan_and_says_why_in_one_line():
    plan = hf_dist.plan(tiny_llama_config(), gpus=8, gpu_memory_gib=80, strategy="zero2", offload="optimizer",
                        verify=True)  # fmt: skip
    assert plan.strategy == "zero2" and plan.trace is None
    assert plan.verification.startswith("not traced zero2")
    assert "\n" not in plan.verification and "CPU offload" in plan.verification
    assert plan.verification.endswith("; the analytic estimate stands")
    bare = hf_dist.plan(7.5e9, gpus=8, gpu_memory_gib=80, verify=True)
    assert bare.trace is None and "bare parameter count" in bare.verification


def test_what_was_checked_is_one_line(monkeypatch):
    """Traced: the layout, the rank, traced against modelled, and the fit; refused: the layout and one short
    reason (here a Liger release the fakes were not derived from); failed: the failure's first line, cut short."""
    from hf_dist.planning.hardware import detect_hardware
    from hf_dist.tracing import TraceError
    from hf_dist.tracing.checked_plan import why_not
    from hf_dist.tracing.liger import version

    traced = hf_dist.plan(tiny_llama_config(), gpus=8, gpu_memory_gib=80, global_batch_size=16, verify=True)
    assert traced.verification.startswith(f"traced {traced.strategy}/none on rank 0 of 8 ranks under fake tensors in ")
    assert " allocated (modelled " in traced.verification and "fits the usable 72.00 GiB" in traced.verification
    monkeypatch.setattr(version, "installed_liger_version", lambda: "0.9.1")
    hardware = detect_hardware(gpus=1, gpu_memory_gib=80, liger_kernel=True)
    refused = hf_dist.plan(tiny_llama_config(), hardware=hardware, use_liger_kernel=True, verify=True)
    assert refused.verification == (
        f"not traced {refused.strategy}/none+liger: Liger kernels: liger-kernel 0.9.1 is installed, but hf_dist's "
        "fake Liger functions copy 0.8.5; install liger-kernel==0.8.5 to trace; the analytic estimate stands"
    )
    long = TraceError("the model failed under ddp x 1 ranks, bf16 while tracing (KeyError: " + "x" * 300 + ")\nmore")
    assert len(why_not(long)) == 160 and why_not(long).endswith("...")
    for line in (traced.verification, refused.verification):
        assert "\n" not in line and len(line) < 250


def test_a_liger_pick_is_traced_with_liger():
    """Liger is what the planner picks on GPUs that have it; verify=True traces that pick with Liger's kernels."""
    from hf_dist.planning.hardware import detect_hardware

    hardware = detect_hardware(gpus=1, gpu_memory_gib=80, liger_kernel=True)
    plan = hf_dist.plan(tiny_llama_config(), hardware=hardware, global_batch_size=16, use_liger_kernel=True,
                        verify=True)  # fmt: skip
    assert plan.use_liger_kernel and plan.trace is not None and plan.trace.setup.use_liger_kernel
    assert plan.verification.startswith(f"traced {plan.strategy}") and "liger" in plan.verification


def test_a_candidate_whose_trace_does_not_fit_is_replaced(monkeypatch):
    """The first traced candidate comes back over the usable memory: it is marked no-fit with the traced figure,
    and the plan moves to the next best, traced in turn."""
    import hf_dist.tracing.api as api

    traced = []

    def fake_trace(config, plan, *, candidate, **kw):
        setup = TraceSetup.from_plan(plan, candidate)
        traced.append(candidate.label)
        peak = 500 * GIB if len(traced) == 1 else candidate.memory.allocated
        return TraceResult(setup, peak, {}, {}, {}, 0.1)

    monkeypatch.setattr(api, "trace_memory", fake_trace)
    plain = hf_dist.plan(tiny_llama_config(), gpus=8, gpu_memory_gib=80, global_batch_size=16)
    plan = hf_dist.plan(tiny_llama_config(), gpus=8, gpu_memory_gib=80, global_batch_size=16, verify=True)
    first = next(c for c in plan.candidates if c.label == traced[0])
    assert not first.fits and first.reason.startswith("traced: 500.00 GiB of tensors")
    assert (plan.strategy, plan.micro_batch_size) != (plain.strategy, plain.micro_batch_size) or \
        plan.activation_checkpointing != plain.activation_checkpointing  # fmt: skip
    assert plan.verification.startswith(f"traced and rejected {traced[0]} (50")
    assert " traced with allocator and context); traced " in plan.verification and "\n" not in plan.verification
    assert plan.gradient_accumulation_steps * plan.micro_batch_size * plan.layout.dp_size == 16
    assert len(traced) == 2


def test_cli_verify_8b_on_64_gpus(tmp_path, capsys):
    """The docs' example (docs/planner.md, Tracing): Llama 3 8B on 8 nodes x 8 GPUs, verified by tracing."""
    folder = tmp_path / "llama-3-8b"
    public_config("llama-3-8b").save_pretrained(folder)
    args = ["plan", str(folder), "--gpus", "64", "--nodes", "8", "--gpu-memory", "80", "--global-batch", "256"]
    assert main([*args, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "chosen: hsdp" in out
    if "verify: not traced" in out:
        # transformers 5.0 builds a KV cache in training (use_cache=True) and accelerate's checkpoint wrapper
        # recomputes each layer into it again: K/V come back twice as long, and torch's checkpoint refuses; the real
        # run fails the same way, and the trace names it instead of giving a number
        assert "the model failed under hsdp" in out and "CheckpointError" in out
        return
    # HSDP without checkpointing at micro_batch 2 x accumulation 2 fits once each micro-batch reduce-scatters
    # (sync_each_batch): under the Trainer's no_sync it held 29.9 GiB of unsharded gradients and the trace rejected it
    assert "sync_each_batch=True, micro_batch=2 x accumulation=2" in out
    assert "verify: traced hsdp/none+sync" in out
    ratio = float(out.split("traced/modelled ")[1].split(")")[0])
    assert 0.95 < ratio < 1.05


@pytest.mark.parametrize("limit", [0, -5.0, float("nan"), float("inf")])
def test_verify_time_limit_must_be_positive(limit, monkeypatch):
    with pytest.raises(ValueError, match=r"time_limit_s must be a positive, finite number of seconds, got .*pass e"):
        hf_dist.trace_memory(tiny_llama_config(), strategy="ddp", time_limit_s=limit)
    assert dataclasses.is_dataclass(TraceResult)
    # a plan with --verify refuses it before the search, naming the flag
    monkeypatch.setattr(checked_plan, "search_plan", lambda *a, **k: pytest.fail("searched before refusing"))
    with pytest.raises(ValueError, match=r"verify_time_limit_s \(--verify-time-limit\) must be a positive"):
        checked_plan.plan(tiny_llama_config(), verify=True, verify_time_limit_s=limit)
