"""How fast this process traces now, against the quiet machine the tracer's default limit was set on.

A trace is fake-tensor dispatch in Python, so it runs as fast as this process gets a core. On a busy 2-core machine
the headline ``--verify`` took 134-140 s and stopped at the fixed 120 s limit. Without an explicit limit,
``plan(verify=True)`` now gives each trace :data:`DEFAULT_LIMIT_S` times how much slower than the reference this
process dispatches (:func:`dispatch_rate`, a fifth of a second), up to :data:`MAX_SCALE` times: a busy machine waits
longer instead of giving up, a quiet one keeps the limit.
"""

from __future__ import annotations

import math
import time

DEFAULT_LIMIT_S = 120.0
# fake-tensor dispatches per second of dispatch_rate() on the idle 2-core machine of docs/measurements.md (the
# tracer's timings there were taken on it): 3,800-7,200 over 27 probes, this the top of them (2026-11-29):
# python -c "from hf_dist.tracing.speed import dispatch_rate as r; print(r())"
REFERENCE_DISPATCHES_PER_S = 7_000.0
MAX_SCALE = 5.0
PROBE_S = 0.2


def dispatch_rate(seconds: float = PROBE_S) -> float:
    """Fake-tensor operations this process dispatches per second, over ``seconds`` of wall time (what it gets of a
    core now, not the fastest it could)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.mm(torch.empty(64, 64), torch.empty(64, 64)).add_(1.0)  # the first dispatch fills the cache
        ops, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            for _ in range(25):
                x = torch.mm(x, x).add_(1.0)
            ops += 50
    return ops / elapsed


def scaled_limit(base_s: float = DEFAULT_LIMIT_S, rate: float | None = None) -> float:
    """``base_s`` stretched by how much slower than the reference this process dispatches now (``rate``: measured
    unless given), between 1x and :data:`MAX_SCALE` x."""
    rate = dispatch_rate() if rate is None else rate
    return base_s * min(max(REFERENCE_DISPATCHES_PER_S / max(rate, 1e-9), 1.0), MAX_SCALE)


def check_time_limit(seconds: float, name: str = "time_limit_s") -> float:
    """``seconds`` when it is a positive, finite number; else a ValueError naming ``name``, the value and the fix."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 < seconds < math.inf):
        raise ValueError(
            f"{name} must be a positive, finite number of seconds, got {seconds!r}; pass e.g. 300, or leave it unset "
            f"for {DEFAULT_LIMIT_S:.0f} s stretched by this machine's speed"
        )
    return float(seconds)
