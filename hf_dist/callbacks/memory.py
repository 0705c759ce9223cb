"""MemoryCallback: per-rank peak memory at each logging step, next to the planner's prediction."""

from __future__ import annotations

import sys
from typing import Any

from transformers import TrainerCallback

from hf_dist.runtime import dist as _dist

GIB = 1024**3


def process_peak_rss_bytes() -> int:
    """Peak resident memory of this process since it started (whole process: Python, libraries, tensors)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _local(tensor: Any) -> Any:
    # FSDP2 parameters are DTensors; count only the shard this rank holds.
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def model_state_bytes(model: Any = None, optimizer: Any = None) -> int:
    """Bytes of parameters, gradients and optimizer state held by this rank (what the planner calls model states)."""
    import torch

    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor):
            t = _local(t)
            if id(t) not in seen and t.device.type != "meta":
                seen.add(id(t))
                total += t.numel() * t.element_size()

    if model is not None:
        for p in model.parameters():
            add(p)
            add(p.grad)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    for state in getattr(inner, "state", {}).values():
        for value in state.values():
            add(value)
    return total


class MemoryCallback(TrainerCallback):
    """Adds ``memory/*`` keys (GiB) to the Trainer's logs at every logging step.

    On CUDA, the same three figures the planner predicts: ``peak_gib`` = ``torch.cuda.max_memory_allocated``
    (peak since the previous log; predicted: ``MemoryEstimate.allocated``), ``reserved_gib`` =
    ``max_memory_reserved`` (predicted: ``reserved``, i.e. + the caching allocator term) and
    ``device_used_gib`` = total - free from ``cudaMemGetInfo`` (predicted: ``total``, + the CUDA context).
    On CPU: the process peak RSS and the bytes of parameters + gradients + optimizer state.
    Values from every rank are gathered (``memory/peak_gib/rank_R``) with their max, so a
    single rank running out of headroom is visible. With a plan, ``memory/predicted_gib`` is
    ``plan.memory.total``, ``memory/predicted/<term>_gib`` each term of the prediction (params, grads,
    optimizer, activations, logits, buffers, allocator, overhead, ...) and ``memory/used_over_predicted``
    the measured device memory (CUDA) over ``total``.
    Use ``hf_dist.callbacks.attach(trainer)`` so the keys reach ``report_to`` backends.
    """

    def __init__(self, plan: Any = None) -> None:
        self.plan = plan
        self._model_states: int | None = None
        self._samples = 0

    def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        # Right after optimizer.step() parameters, gradients and optimizer state all exist; by
        # on_log the Trainer has already freed the gradients (zero_grad sets them to None).
        # Their sizes are fixed once the optimizer has created its state, so two samples suffice
        # and later steps pay nothing.
        if self._samples < 2:
            self._samples += 1
            self._model_states = max(self._model_states or 0, model_state_bytes(model, optimizer))

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def measure(self, model: Any = None, optimizer: Any = None) -> dict[str, float]:
        """This rank's figures in GiB (no collective); model states as of the last optimizer step when known."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info()
            out = {
                "peak_gib": torch.cuda.max_memory_allocated() / GIB,
                "reserved_gib": torch.cuda.max_memory_reserved() / GIB,
                "device_used_gib": (total - free) / GIB,
            }
            torch.cuda.reset_peak_memory_stats()
        else:
            out = {"peak_gib": process_peak_rss_bytes() / GIB, "reserved_gib": 0.0}
        states = self._model_states if self._model_states is not None else model_state_bytes(model, optimizer)
        out["model_states_gib"] = states / GIB
        return out

    def on_log(self, args, state, control, logs=None, model=None, optimizer=None, **kwargs):
        if logs is None or "loss" not in logs:
            return  # eval and end-of-train summaries: no training step to measure
        mine = self.measure(model, optimizer)
        keys = sorted(mine)
        ranks = _dist.gather_floats([mine[k] for k in keys])
        metrics: dict[str, float] = {}
        for i, key in enumerate(keys):
            values = [r[i] for r in ranks]
            metrics[f"memory/{key}_max"] = round(max(values), 6)
            if key == "peak_gib":
                metrics.update({f"memory/peak_gib/rank_{r}": round(v, 6) for r, v in enumerate(values)})
        memory = getattr(self.plan, "memory", None)
        if memory is not None:
            metrics["memory/predicted_gib"] = round(memory.total / GIB, 6)
            metrics["memory/predicted_model_states_gib"] = round(memory.model_states / GIB, 6)
            for term, value in memory.to_dict().items():
                metrics[f"memory/predicted/{term}_gib"] = round(value / GIB, 6)
            if "memory/device_used_gib_max" in metrics and memory.total:
                metrics["memory/used_over_predicted"] = round(
                    metrics["memory/device_used_gib_max"] * GIB / memory.total, 4
                )
        _add_to_logs(state, logs, metrics)


def _add_to_logs(state: Any, logs: dict, metrics: dict) -> None:
    """Put ``metrics`` in this log event and in its ``state.log_history`` entry (written before on_log)."""
    logs.update(metrics)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(metrics)
