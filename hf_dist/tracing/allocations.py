"""The traced run's allocations in order, replayed through torch's caching allocator: what the run reserves.

The tracker sees every storage made and freed, in the order the run makes them (:mod:`hf_dist.tracing.trace`).
:class:`AllocationLog` keeps that order; :meth:`AllocationLog.reserved_bytes` rebuilds the run's history from it --
the model's storages, then the traced step again and again, the first time with the optimizer state made where the
run's first ``optimizer.step()`` makes it (the trace makes it before the step, :func:`trace.create_optimizer_state`)
-- and replays it through :class:`hf_dist.planning.allocator.CachingAllocator`. Checked against
``torch.cuda.max_memory_reserved`` of every traceable GPU run (``python benchmarks/gpu_ground_truth.py --trace``).

Streams: a storage made while :func:`on_stream` names a stream is logged with it (:attr:`AllocationLog.streams`) and
replayed in that stream's pool, as CUDA's caching allocator serves each stream from its own blocks. DeepSpeed's
shims name the streams its ZeRO optimizers reduce and gather on (:func:`hf_dist.tracing.zero_shims.traced_streams`);
FSDP2's streams are not separated, and the memory model adds the blocks they cache
(:func:`hf_dist.planning.transients.comm_stream_reserve_bytes`).
"""

from __future__ import annotations

import contextlib
from typing import Any

OPTIMIZER_PHASE = "optimizer step"

# the stream the traced code allocates on now (None: the default stream); one for the process, not per thread: the
# autograd engine may run backward hooks (DeepSpeed's reductions) on a device thread while the tracing thread waits
_CURRENT_STREAM: list[Any] = [None]


def current_stream() -> Any:
    """The stream a storage made now is allocated on (None: the default stream)."""
    return _CURRENT_STREAM[0]


@contextlib.contextmanager
def on_stream(stream: Any):
    """Storages made within the block are allocated on ``stream`` (a hashable name; None: the default stream), as
    torch allocates on the current stream inside ``with torch.cuda.stream(stream)``."""
    saved = _CURRENT_STREAM[0]
    _CURRENT_STREAM[0] = stream
    try:
        yield
    finally:
        _CURRENT_STREAM[0] = saved


class AllocationLog:
    """Storages made (``(key, bytes)``) and freed (``(key, None)``) in order, with the phases of the traced step."""

    def __init__(self) -> None:
        self.setup: list[tuple[int, int | None]] = []
        self.state: list[tuple[int, int]] = []  # the optimizer state, made before the step (first step's)
        self.step: list[tuple[int, int | None]] = []
        self.optimizer_at: int | None = None  # index in ``step`` where the (first) optimizer step begins
        self.streams: dict[int, Any] = {}  # key -> the stream it is allocated on, for keys not on the default stream
        self._started = False
        self._next = 0

    def record(self, update: Any, winfo: Any, is_state: bool, restarted: bool = False) -> None:
        """One ``MemTracker._update_snap`` call: an ADD makes a storage, a DEL frees it, a SIZE (``resize_``, FSDP2's
        unsharded parameters) frees it and makes one of the new size; a REF (a new category) allocates nothing. A
        storage is made on :func:`current_stream` (``restarted``: on the stream it was first made on)."""
        name = getattr(update, "name", str(update))
        if name in ("DEL", "SIZE"):
            self._add((getattr(winfo, "_hf_dist_key", -1), None))
        if name in ("ADD", "SIZE"):
            winfo._hf_dist_key = self._next
            self._next += 1
            stream = getattr(winfo, "_hf_dist_stream", None) if restarted else current_stream()
            winfo._hf_dist_stream = stream
            if stream is not None:
                self.streams[winfo._hf_dist_key] = stream
            event = (winfo._hf_dist_key, int(winfo.mem_consumed))
            if not self._started and is_state:
                self.state.append(event)
            else:
                self._add(event)

    def restart(self, live: Any) -> None:
        """Forget what was logged: the storages ``live`` names (the tracker's records of those alive now) are the
        set-up, made in that order, and the steps start afresh (the DeepSpeed engine's start,
        :mod:`hf_dist.tracing.zero`, whose transients on the fake module a GPU does not hold)."""
        self.setup, self.state, self.step, self.optimizer_at, self.streams = [], [], [], None, {}
        self._started = False
        for winfo in live:
            self.record("ADD", winfo, False, restarted=True)

    def phase(self, name: str) -> None:
        self._started = self._started or bool(name)
        if name == OPTIMIZER_PHASE and self.optimizer_at is None:
            self.optimizer_at = len(self.step)

    def _add(self, event: tuple[int, int | None]) -> None:
        (self.step if self._started else self.setup).append(event)

    def reserved_bytes(self) -> tuple[int, int]:
        """(peak reserved, peak allocated) of the run's history replayed through the caching allocator."""
        allocator = self.replay()
        return allocator.peak_reserved, allocator.peak_allocated

    def replay(self) -> Any:
        """The caching allocator after the run's history, each storage in its stream's pool."""
        from hf_dist.planning.allocator import replay_training

        return replay_training(
            self.setup, self.step, first_step_extra=self.state,
            extra_at=self.optimizer_at if self.state else None, streams=self.streams,
        )  # fmt: skip
