"""Marks for tests whose expected figures were read from one library version's code, each saying why it skips
elsewhere (the lowest supported set's differences: docs/testing.md)."""

from __future__ import annotations

import pytest

from hf_dist.planning.moe import experts_code_as_modelled
from hf_dist.tracing.zero_shims import installed_version, version_reason

# another DeepSpeed (the lowest supported set has 0.17) is refused for tracing, which
# tests/unit/tracing/test_zero.py::test_a_zero3_plan_with_another_deepspeed_is_not_traced asserts on every version
_DEEPSPEED_REFUSAL = version_reason(installed_version())
needs_traced_deepspeed = pytest.mark.skipif(bool(_DEEPSPEED_REFUSAL), reason=str(_DEEPSPEED_REFUSAL))

# the MoE terms are read from transformers 5.24's experts and routers; earlier 5.x differ (docs/planner.md)
moe_code_as_modelled = pytest.mark.skipif(
    not experts_code_as_modelled(),
    reason="this transformers' experts are not the 5.24 code the MoE terms were read from",
)
