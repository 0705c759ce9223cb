"""The phases of a run and the clock that times them: what the hang watchdog and the straggler detector ask.

A run goes through phases that take very different times: the first step after every start or resume (compilation,
warm-up, cold caches), the steps after it, evaluations, checkpoint saves (synchronous, or an async save's staging
and its waits for the background writes), exports, and the load of the best checkpoint at the end.
:class:`~hf_dist.callbacks.watchdog.HangWatchdogCallback` gives each phase its own allowance, learned from that
phase's own durations, and the straggler detector (:mod:`hf_dist.callbacks.stragglers`) does not count a rank's time
in a save, an evaluation or an export as lateness.

The code that runs a phase says so, ``with phase(Phase.SAVE): ...`` (the checkpoint callbacks, the exports), and
the Trainer extension (:mod:`hf_dist.callbacks.extension`) runs a Trainer's ``evaluate``, ``_save_checkpoint`` and
``_load_best_model`` as phases. Progress inside a phase (a step's begin and end, an evaluation batch, a log) is a
:meth:`PhaseClock.beat`. :data:`CLOCK`, one per process, knows the phase under way, the silence since the last beat,
and for each phase the longest silence of its finished instances.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Phase(enum.Enum):
    """What a rank is doing; each phase has its own allowance (``HangWatchdogCallback``)."""

    FIRST_STEP = "first step"  # the first step after every start or resume
    STEP = "step"  # every later step, with its data loading and logging
    EVALUATE = "evaluation"  # Trainer.evaluate, in training or after it
    SAVE = "save"  # a checkpoint: the Trainer's save, an async save's staging and waits, the completion marker
    EXPORT = "export"  # a consolidated HF folder: ExportCallback, the recipes' export
    LOAD = "checkpoint load"  # the best checkpoint, loaded at the end (load_best_model_at_end)

    @property
    def between_steps(self) -> bool:
        """Work done between two training steps: a rank's time in it is not lateness at the next step."""
        return self not in (Phase.FIRST_STEP, Phase.STEP)


class PhaseClock:
    """The phase under way, the silence since the last beat, and each phase's longest silence (one per process).

    The training loop sets the baseline (:meth:`start_training`: the first step; :meth:`step_ended`: the steps
    after it; :meth:`stop_training`: none); :meth:`enter` / :meth:`leave` open and close a phase above it. A silence
    belongs to the phase under way while it lasts. A phase's instance ends at its :meth:`leave` (a step: at its
    end), and only then does its longest silence count in :attr:`longest`: an instance under way never lowers the
    allowance it is judged by. A step that follows a save, an evaluation or an export teaches nothing: a rank that
    finished its part of the save early waits there for the others, and that wait is not a step's pace.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()  # the watchdog's thread reads while the training thread writes
        self.reset()

    def reset(self) -> None:
        """Forget everything learned (a new process starts like this)."""
        with self._lock:
            self.longest: dict[Phase, float] = {}  # the longest silence of a finished instance, per phase
            self.entered = 0  # phases entered so far (the straggler detector compares it between steps)
            self._open: list[list[Any]] = []  # [phase, its longest silence so far], innermost last
            self._baseline: Phase | None = None
            self._baseline_longest = 0.0
            self._entered_by_step = 0  # self.entered when the last step ended
            self.last_beat = self.clock()

    @property
    def current(self) -> Phase | None:
        """The phase under way: the innermost one entered, else the training loop's; None outside both."""
        with self._lock:
            return self._open[-1][0] if self._open else self._baseline

    def silence(self) -> float:
        """Seconds since the last beat."""
        return self.clock() - self.last_beat

    def beat(self) -> None:
        """Progress: the silence that ends now belongs to the phase under way."""
        with self._lock:
            self._beat()

    def _beat(self) -> None:
        now = self.clock()
        silence = now - self.last_beat
        if self._open:
            self._open[-1][1] = max(self._open[-1][1], silence)
        elif self._baseline is not None:
            self._baseline_longest = max(self._baseline_longest, silence)
        self.last_beat = now

    def enter(self, phase: Phase) -> None:
        with self._lock:
            self._beat()
            self._open.append([phase, 0.0])
            self.entered += 1

    def leave(self, phase: Phase, *, finished: bool = True) -> None:
        """Close the innermost ``phase``; a ``finished`` one teaches its phase's allowance (a failed one does not)."""
        with self._lock:
            self._beat()
            indices = [i for i, (which, _) in enumerate(self._open) if which is phase]
            if not indices:  # opened before a reset()
                return
            _, longest = self._open.pop(indices[-1])
            if finished:
                self._learn(phase, longest)

    def start_training(self) -> None:
        """The training loop begins: its first step is under way."""
        with self._lock:
            self._beat()
            self._baseline, self._baseline_longest = Phase.FIRST_STEP, 0.0
            self._entered_by_step = self.entered

    def step_ended(self) -> None:
        """A training step ended: it teaches its phase's allowance (unless a phase came before it), and the next one
        is a later step."""
        with self._lock:
            self._beat()
            if self._baseline is not None and self.entered == self._entered_by_step:
                self._learn(self._baseline, self._baseline_longest)
            self._baseline, self._baseline_longest = Phase.STEP, 0.0
            self._entered_by_step = self.entered

    def stop_training(self) -> None:
        """The training loop is over: only the phases entered after it are timed."""
        with self._lock:
            self._beat()
            self._baseline = None

    def _learn(self, phase: Phase, silence: float) -> None:
        self.longest[phase] = max(self.longest.get(phase, 0.0), silence)


CLOCK = PhaseClock()


@contextlib.contextmanager
def phase(which: Phase, clock: PhaseClock | None = None) -> Iterator[None]:
    """Run the block as phase ``which`` of this process (:data:`CLOCK` unless ``clock`` is given)."""
    clock = clock if clock is not None else CLOCK
    clock.enter(which)
    finished = False
    try:
        yield
        finished = True
    finally:
        clock.leave(which, finished=finished)


def running_trainer() -> Any:
    """The Trainer whose training loop the calling thread is in, or None.

    The Trainer passes its callbacks the model, optimizer and data, not itself; ``attach()`` gives it to those that
    ask, and this finds it for a callback given to ``Trainer(callbacks=[...])``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop":
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None
