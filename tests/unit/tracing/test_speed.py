"""`--verify`'s default limit follows this machine's speed now: 120 s on the quiet reference machine, stretched (up
to 5x) when this process dispatches slower, never shortened; an explicit limit is kept as given (issue 39)."""

import pytest

import hf_dist.tracing.checked_plan as checked_plan
from hf_dist.planning.hardware import Hardware
from hf_dist.testing import tiny_llama_config
from hf_dist.tracing.speed import DEFAULT_LIMIT_S, MAX_SCALE, REFERENCE_DISPATCHES_PER_S, dispatch_rate, scaled_limit


@pytest.mark.parametrize(
    ("slower", "limit"),
    [(1.0, DEFAULT_LIMIT_S), (2.0, 2 * DEFAULT_LIMIT_S), (0.5, DEFAULT_LIMIT_S), (100.0, MAX_SCALE * DEFAULT_LIMIT_S)],
)
def test_the_limit_stretches_with_how_much_slower_this_process_dispatches(slower, limit):
    assert scaled_limit(rate=REFERENCE_DISPATCHES_PER_S / slower) == pytest.approx(limit)


def test_the_probe_measures_fake_dispatches_per_second():
    assert dispatch_rate(0.05) > 0


@pytest.mark.parametrize(("given", "used"), [(None, 333.0), (30.0, 30.0)])
def test_plan_verify_uses_the_stretched_limit_unless_one_is_given(monkeypatch, given, used):
    seen = {}

    def verify_plan(plan, *, time_limit_s, **kwargs):
        seen["limit"] = time_limit_s
        return plan

    monkeypatch.setattr(checked_plan, "scaled_limit", lambda: 333.0)
    monkeypatch.setattr(checked_plan, "verify_plan", verify_plan)
    hw = Hardware(device="cuda", gpus_per_node=8, gpu_memory_gib=24.0, peak_tflops=100.0)
    checked_plan.plan(tiny_llama_config(), hardware=hw, seq_len=64, verify=True, verify_time_limit_s=given)
    assert seen["limit"] == used
