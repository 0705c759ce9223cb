"""Straggler detection: which rank makes the others wait.

Under data parallelism every rank's step takes the same wall time (the collectives wait for the slowest), so the
step time cannot name the rank that is slow. What differs is when each rank arrives at its step's forward: a rank
slowed by its host (data, callbacks, a busy CPU) or by a slower device arrives after the others, which then wait
for it in the collectives. :class:`Arrivals` records, per micro-step, the wall-clock time a rank calls the
outermost training module (before DDP's, FSDP's or DeepSpeed's own forward collectives); :func:`stragglers` names
the ranks that arrive far after the median rank.

A rank's time in a save, an evaluation or an export (:mod:`hf_dist.callbacks.phases`) is not lateness. Rank 0 alone
writes an export or stages an async save's weights and optimizer; where nothing syncs the ranks before the next step
(``average_tokens_across_devices=False``), it arrives late there for that reason only. So the step that follows such
a phase is not counted; the phases run on every rank, so every rank leaves out the same steps.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from typing import Any

logger = logging.getLogger("hf_dist")

LATE_FRACTION = 0.2  # a rank arriving this fraction of a step after the median rank is a straggler...
MIN_LATE_S = 0.05  # ... if that is at least this many seconds per step (clock skew between hosts, timer noise)


class Arrivals:
    """The sum of the wall-clock times this rank arrived at each micro-step's forward, over the optimizer steps
    counted since the last :meth:`take`; a step is counted at its end unless it is ``excused``."""

    def __init__(self) -> None:
        self.total = 0.0
        self.steps = 0
        self._step_total = 0.0
        self._armed = False

    def step_began(self) -> None:
        self._armed = True

    def forward_called(self) -> None:
        if self._armed:  # the micro-step's first call of the outermost module
            self._step_total += time.time()
            self._armed = False

    def step_ended(self, *, excused: bool = False) -> None:
        """The optimizer step ended; ``excused``: a save, evaluation or export came before it (not counted)."""
        if not excused:
            self.total += self._step_total
            self.steps += 1
        self._step_total = 0.0

    def take(self) -> tuple[float, int]:
        """(sum of arrival times, steps counted) since the last take."""
        out = (self.total, self.steps)
        self.total, self.steps = 0.0, 0
        return out


def stragglers(arrival_sums: list[float], steps: int, step_time: float) -> dict[int, float]:
    """``{rank: seconds per step it arrived after the median rank}`` for the ranks late by more than
    ``LATE_FRACTION`` of ``step_time`` and ``MIN_LATE_S``. ``arrival_sums``: each rank's sum from :meth:`Arrivals.take`
    over the same ``steps`` counted optimizer steps."""
    if len(arrival_sums) < 2 or steps < 1:
        return {}
    median = statistics.median(arrival_sums)
    late = {rank: (total - median) / steps for rank, total in enumerate(arrival_sums)}
    return {r: s for r, s in late.items() if s >= max(MIN_LATE_S, LATE_FRACTION * step_time)}


def hostnames() -> list[str]:
    """Every rank's host name, indexed by rank (one collective; once per run)."""
    from hf_dist.runtime import dist as _dist

    return _dist.gather_objects(socket.gethostname())


def report(found: dict[int, float], hosts: list[str], step_time: float, step: int) -> dict[str, Any]:
    """Log keys for the stragglers ``found`` and one warning line (rank 0)."""
    if not found:
        return {}
    from hf_dist.runtime import dist as _dist

    named = ", ".join(
        f"rank {r} on {hosts[r] if r < len(hosts) else '?'} ({s:.2f} s, {s / step_time:.0%} of a step)"
        for r, s in found.items()
    )
    if _dist.rank() == 0:
        logger.warning(
            "hf_dist: straggler at step %d: %s arrives after the median rank; every other rank waits for it in the "
            "collectives",
            step, named,
        )  # fmt: skip
    return {f"perf/straggler_rank_{r}_late_s": round(s, 4) for r, s in found.items()}
