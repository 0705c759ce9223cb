"""Exact per-rank training memory from the real model, traced with fake tensors and a fake process group.

``trace_memory(model, plan)`` builds the model of ``model``'s config (no weights), prepares it as ``auto_args()`` +
the Trainer would run ``plan`` on rank 0 of ``plan.world_size`` ranks, and runs a warm-up and a full training step
under ``FakeTensorMode``: nothing is allocated, no GPU is needed, and 512 ranks cost what 8 do. See docs/planner.md,
"Tracing".
"""

from __future__ import annotations

from hf_dist.tracing.api import trace_memory
from hf_dist.tracing.result import TraceError, TraceResult, TraceTimeout
from hf_dist.tracing.setup import TraceSetup, TraceUnsupported

__all__ = ["trace_memory", "TraceSetup", "TraceResult", "TraceError", "TraceTimeout", "TraceUnsupported"]
