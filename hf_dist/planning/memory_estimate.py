"""One layout's memory per rank, by component (:class:`MemoryEstimate`): what :func:`hf_dist.planning.memory.estimate_memory`
returns, and the moments its peak is the largest of."""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist.planning.dtypes import GIB


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by component.

    ``total`` is the predicted device memory in use at the peak, ``allocated`` the peak of live
    tensors (``torch.cuda.max_memory_allocated``), ``reserved`` what the caching allocator holds
    (``max_memory_reserved``). ``cpu`` is host memory per rank used by offloaded states.

    The peak is the largest of three moments: the start of backward, when every saved activation and the loss's
    logits are alive; a decoder layer's backward, when its gathered units (``unit_buffers``: FSDP2 / ZeRO-3) and,
    under activation checkpointing, its recomputed activations (``recompute``) are, with the gradients its backward
    has in flight (``layer_grads``), but no longer the logits; and
    the optimizer step, when the gradients and the step's transients are (``grads_overlap_activations``). With
    one micro-batch per step the Trainer frees gradients after each step (``zero_grad(set_to_none=True)``), so
    gradients and activations never coexist in full: their largest overlap is the backward of the first decoder
    layer, the last one run, when every other gradient exists next to that layer's activations (``last_layer``:
    recomputed under checkpointing, else saved) and gathered units; with gradient accumulation the gradients
    persist through the next forward. Under FSDP2 a fourth moment is the last decoder layer's all-gather copy-out in
    forward (``forward_gather``, :func:`forward_gather_bytes`). ``activations`` includes ``recompute`` and ``buffers``
    includes ``unit_buffers``.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    overhead: int
    cpu: int = 0
    grads_overlap_activations: bool = False
    logits: int = 0
    step: int = 0
    allocator: int = 0
    recompute: int = 0
    unit_buffers: int = 0
    last_layer: int = 0
    layer_grads: int = 0
    forward_gather: int = 0  # FSDP2's last forward copy-out: earlier layers' activations + 3 gathered layers
    released_at_step: int = 0  # part of ``buffers`` freed before the optimizer step (ZeRO-3's gathered parameters)
    swap: int = 0  # ZeRO-Infinity's swap files under nvme_path (offload_device="nvme"), not memory
    comm_reserve: int = 0  # the part of ``allocator`` the collectives' streams cache (transients.comm_stream_...)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def allocated(self) -> int:
        layer_moment = self.recompute + self.unit_buffers + self.layer_grads
        forward_backward = self.activations - self.recompute + max(self.logits, layer_moment)
        if self.grads_overlap_activations:
            # the first decoder layer's backward, the last one run: every other gradient exists, and only that
            # layer's activations, gathered units and gradients in flight are still alive
            end_of_backward = self.grads + self.last_layer + self.unit_buffers + self.layer_grads
            transient = max(
                forward_backward, end_of_backward, self.grads + self.step - self.released_at_step, self.forward_gather
            )
        else:
            transient = max(
                forward_backward + self.grads,
                self.grads + self.step - self.released_at_step,
                self.forward_gather + self.grads,
            )
        return self.params + self.optimizer + self.buffers - self.unit_buffers + transient

    @property
    def reserved(self) -> int:
        return self.allocated + self.allocator

    @property
    def total(self) -> int:
        return self.reserved + self.overhead

    def to_dict(self) -> dict[str, int]:
        keys = ("params", "grads", "optimizer", "activations", "logits", "buffers", "step", "allocator", "overhead")
        keys += ("cpu", "swap", "model_states", "allocated", "reserved", "total")
        return {k: int(getattr(self, k)) for k in keys}

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.to_dict().items()}
