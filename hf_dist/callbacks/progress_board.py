"""Where the ranks' hang watchdogs tell each other whether they make progress: counters in the process group's store.

No collective: a hung rank cannot join one. The store (torchrun's or accelerate's TCPStore, the one the process group
was made with) answers from its own thread, whatever the ranks' Python does. Each rank counts itself in ``ok`` while
it makes progress within its phase's allowance; the run is hung only when ``ok`` is 0, that is when no rank makes
progress in any phase. A rank that counts itself but can no longer say otherwise (its process killed, its watchdog
thread starved) would keep the run "alive" forever, so every rank that counts itself also adds to ``beats`` at each
check, and ``ok`` is believed only while ``beats`` moves. The rank that finds the run hung writes the step and raises
``hung``; every rank's watchdog reads it at its next check and writes its stacks.
"""

from __future__ import annotations

import logging
from typing import Any

from hf_dist.runtime.bootstrap import round_name

logger = logging.getLogger("hf_dist")

STALE_S = 30.0  # ranks that count themselves check every second at most: no beat for this long means none can


class ProgressBoard:
    """This rank's view of every rank's progress, over ``store`` (any c10d ``Store``: ``add``, ``set``, ``get``)."""

    def __init__(self, store: Any, *, stale_s: float = STALE_S) -> None:
        self.store, self.stale_s = store, stale_s
        self._ok = False
        self._beats, self._beats_seen_at = -1, None

    @classmethod
    def for_this_process(cls) -> ProgressBoard:
        """The process group's store, under a prefix of this launch attempt; a store of this process alone when no
        process group runs (or its store cannot be reached)."""
        import torch.distributed as dist

        store = None
        if dist.is_available() and dist.is_initialized():
            try:
                from torch.distributed.distributed_c10d import _get_default_store

                store = _get_default_store()
            except Exception as exc:  # a private torch function: if it moves, watch this rank alone
                logger.warning("hf_dist: the hang watchdog cannot reach the process group's store (%s): each rank "
                               "is judged alone", exc)  # fmt: skip
        if store is None:
            store = dist.HashStore()
        # a restarted job may reuse the store: keyed by the launch round all ranks agree on
        return cls(dist.PrefixStore(f"hf_dist_watchdog/{round_name()}", store))

    def report(self, ok: bool) -> None:
        """Whether this rank makes progress within its allowance; counted on each change, and beating while ok."""
        if ok != self._ok:
            self.store.add("ok", 1 if ok else -1)
            self._ok = ok
        if ok:
            self.store.add("beats", 1)

    def anyone_ok(self, now: float) -> bool:
        """Whether some rank makes progress within its allowance (and is still there to say so) at ``now``."""
        if self.store.add("ok", 0) <= 0:
            return False
        beats = self.store.add("beats", 0)
        if beats != self._beats or self._beats_seen_at is None:
            self._beats, self._beats_seen_at = beats, now
        return now - self._beats_seen_at <= self.stale_s

    def declare(self, step: int) -> None:
        """The run is hung after ``step``: every rank's watchdog writes its stacks at its next check."""
        self.store.set("hung_step", str(step))
        self.store.add("hung", 1)

    def declared(self) -> int | None:
        """The step after which a rank declared the run hung, or None."""
        if self.store.add("hung", 0) <= 0:
            return None
        return int(self.store.get("hung_step"))

    def leave(self) -> None:
        """This rank's watch ends: it no longer counts itself."""
        self.report(False)
