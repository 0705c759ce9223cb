"""What a trace found (:class:`TraceResult`: rank 0's peak, by memory-model term, and what the allocator reserves),
and how a trace fails (:class:`TraceError`, :class:`TraceTimeout`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_dist.tracing.setup import TraceSetup

# the trackers' categories as the memory model names its terms (hf_dist.planning.memory.MemoryEstimate)
TERMS = {
    "Parameter": "params", "Sharded Param": "params",
    "Gradient": "grads", "Sharded Grad": "grads", "Unsharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Buffer": "buffers", "Unsharded Param": "buffers", "All Gather": "buffers", "Reduce Scatter": "buffers",
    "Other": "buffers",  # DDP's Reducer buckets (prepare.ddp_buckets)
    "Inputs": "inputs",
}  # fmt: skip
TERM_ORDER = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "inputs")


class TraceError(RuntimeError):
    """The trace could not run to the end; the message says where, and that the analytic estimate stands."""


class TraceTimeout(TraceError):
    """The trace ran past its time limit; ``partial`` holds the peak of what ran."""

    def __init__(self, message: str, partial: TraceResult | None = None) -> None:
        super().__init__(message)
        self.partial = partial


@dataclass(frozen=True)
class TraceResult:
    """Rank 0's traced memory for one layout.

    ``peak_bytes``: the largest sum of live tensors (what ``torch.cuda.max_memory_allocated`` reports);
    ``terms``: that peak by memory-model term (params, grads, optimizer, activations, temporaries — gradients of
    activations and other backward/step intermediates —, buffers — gathered FSDP units, communication buffers,
    module buffers —, inputs); ``categories``: the tracker's own names; ``states``: params and optimizer state
    after the step, the model states at rest; ``reserved_bytes``: what the caching allocator reserves for the traced
    allocations over the run's steps (``max_memory_reserved``; 0 when the trace was cut short). ``complete`` is False when the time limit stopped the trace: the
    peak is then of what ran.
    """

    setup: TraceSetup
    peak_bytes: int
    terms: dict[str, int]
    categories: dict[str, int]
    states: dict[str, int]
    seconds: float
    complete: bool = True
    peak_phase: str = ""
    notes: list[str] = field(default_factory=list)
    reserved_bytes: int = 0
    engine: str = ""  # what ran besides torch: "DeepSpeed 0.19.8" for ZeRO layouts
    # the engine's streams whose allocations the replay served from their own pools (DeepSpeed's reduction and
    # all-gather streams, tracing/zero_shims.py); empty: one stream, the collectives' streams from the memory model
    streams: list[str] = field(default_factory=list)

    def checked(self) -> str:
        """What the trace ran, in a few words: ``rank 0 of 64 ranks, DeepSpeed 0.19.8's engine``."""
        what = f"rank 0 of {self.setup.world_size} ranks"
        return what + (f", {self.engine}'s engine" if self.engine else "") + " under fake tensors"

    def device_total(self, estimate: Any) -> int:
        """Device memory in use at the peak: what the caching allocator reserves for the traced allocations, replayed
        over the run's steps (``reserved_bytes``, :mod:`hf_dist.tracing.allocations`), plus what the memory model adds
        outside it (the CUDA context, and the blocks the collectives' streams cache:
        :func:`~hf_dist.planning.transients.comm_stream_reserve_bytes`, unless the replay served the engine's
        streams from pools of their own: ``streams``, a DeepSpeed trace). A trace cut short has no replay: its peak
        plus the model's reserve."""
        if not self.reserved_bytes:
            return self.peak_bytes + estimate.total - estimate.allocated
        comm = 0 if self.streams else estimate.comm_reserve
        return self.reserved_bytes + comm + estimate.overhead

    def to_dict(self) -> dict[str, Any]:
        return {
            "setup": self.setup.to_dict(), "peak_bytes": self.peak_bytes, "terms": self.terms,
            "categories": self.categories, "states": self.states, "seconds": self.seconds,
            "complete": self.complete, "peak_phase": self.peak_phase, "notes": list(self.notes),
            "reserved_bytes": self.reserved_bytes, "engine": self.engine, "streams": list(self.streams),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceResult:
        return cls(**{**data, "setup": TraceSetup.from_dict(data["setup"])})

    def compare(self, estimate: Any) -> str:
        """Traced against modelled memory per term, for ``Plan.explain()`` and ``hf-dist plan --verify``."""
        from hf_dist.planning.plan_result import format_bytes

        modelled = {
            "params": estimate.params, "grads": estimate.grads, "optimizer": estimate.optimizer,
            "activations": estimate.activations + estimate.logits, "temporaries": estimate.step,
            "buffers": estimate.buffers,
        }  # fmt: skip
        rows = [("term", "traced at the peak", "modelled")]
        rows += [(t, format_bytes(self.terms.get(t, 0)), format_bytes(modelled[t]) if t in modelled else "-")
                 for t in TERM_ORDER if self.terms.get(t, 0) or modelled.get(t, 0)]  # fmt: skip
        ratio = self.peak_bytes / estimate.allocated if estimate.allocated else float("nan")
        rows.append(("allocated", format_bytes(self.peak_bytes), f"{format_bytes(estimate.allocated)} "
                     f"(traced/modelled {ratio:.3f})"))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        state = "" if self.complete else " (stopped at its time limit: the peak of what ran)"
        head = f"traced rank 0 in {self.seconds:.1f} s{state}; the modelled activations include the logits:"
        return "\n".join([head, *lines, *(f"  note: {n}" for n in self.notes)])
