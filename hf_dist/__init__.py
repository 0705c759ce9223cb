"""hf_dist: distributed fine-tuning for Hugging Face models, decided by memory math.

The public API is imported lazily: ``import hf_dist`` imports neither torch-heavy modules nor
deepspeed; each name is loaded from its module on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "ModelSpec": "hf_dist.planning.modelinfo",
    "model_spec": "hf_dist.planning.modelinfo",
    "MemoryEstimate": "hf_dist.planning.memory_estimate",
    "estimate_memory": "hf_dist.planning.memory",
    "STRATEGIES": "hf_dist.planning.layout",
    "Layout": "hf_dist.planning.layout",
    "Hardware": "hf_dist.planning.hardware",
    "detect_hardware": "hf_dist.planning.hardware",
    "Plan": "hf_dist.planning.plan_result",
    "Candidate": "hf_dist.planning.plan_result",
    "plan": "hf_dist.tracing.checked_plan",
    "PlanRequest": "hf_dist.planning.request",
    "PlanError": "hf_dist.planning.plan_result",
    "RemoteCodeError": "hf_dist.planning.remote_code",
    "fsdp_wrap_classes": "hf_dist.planning.wrap",
    "auto_args": "hf_dist.auto",
    "fsdp_config": "hf_dist.configs.fsdp",
    "deepspeed_config": "hf_dist.configs.deepspeed",
    "accelerate_config": "hf_dist.configs.accelerate",
    "from_pretrained_kwargs": "hf_dist.auto",
    "convert": "hf_dist.checkpoint.conversion.convert",
    "verify": "hf_dist.checkpoint.conversion.verify",
    "auto_resume": "hf_dist.checkpoint.lifecycle.auto_resume",
    "attach": "hf_dist.callbacks",
    "prepare_resume": "hf_dist.checkpoint.lifecycle.reshard",
    "run_bench": "hf_dist.bench",
    "trace_memory": "hf_dist.tracing",
    "TraceResult": "hf_dist.tracing",
}

# public subpackages, imported on first use: ``hf_dist.callbacks.attach(trainer)`` after a bare ``import hf_dist``
_SUBMODULES = ("callbacks",)

__all__ = sorted([*_LAZY, *_SUBMODULES]) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f"hf_dist.{name}")
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_dist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
