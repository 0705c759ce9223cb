"""Marks for tracing tests that run DeepSpeed's engine under hf_dist's shims (derived from DeepSpeed 0.19.8)."""

from __future__ import annotations

import pytest

from hf_dist.tracing.zero_shims import installed_version, version_reason

# another DeepSpeed (the lowest supported set has 0.17) is refused for tracing, which
# test_zero.py::test_a_zero3_plan_with_another_deepspeed_is_not_traced asserts on every version
needs_traced_deepspeed = pytest.mark.skipif(
    bool(version_reason(installed_version())), reason=f"{version_reason(installed_version())}"
)
