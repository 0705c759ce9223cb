"""HangWatchdogCallback: a hung job ends in minutes with every rank's stacks, not after the distributed timeout.

A thread on every rank times the silence since the rank last made progress (a step's begin or end, an evaluation
batch, a log, a phase's begin or end: :mod:`hf_dist.callbacks.phases`) against the allowance of the phase under way:
the first step after every start or resume, a later step, an evaluation, a save (synchronous, or an async save's
staging and its waits), an export, the load of the best checkpoint at the end. Each phase's allowance is learned
from that phase's own finished instances: ``factor`` times the longest silence seen in it, at least ``min_limit_s``;
``first_limit_s`` until one instance has finished (the first step after a start or resume, the first save, the first
evaluation). ``limit_s``, when given, is the allowance of every phase. Allowances stay under the process group's
timeout (``ddp_timeout``): a collective would time out first, with no stacks; a ``limit_s`` at or above it is
refused.

A rank over its allowance does not end the run alone: the run is hung only when no rank makes progress within its
phase's allowance (:mod:`hf_dist.callbacks.progress_board`), so a rank waiting in a step's collective for a rank
that stages a long save is not a hang. Then every rank writes the Python stacks of all its threads to
``<output_dir>/hang/<step>/rank<R>.txt`` (its phase, silence and allowance first), rank 0 waits a moment for the
others' files and prints, for each rank, its phase and the innermost frame its main thread is in, and every rank
exits with :data:`HANG_EXIT_CODE`. The run resumes from its last complete checkpoint (``hf_dist.auto_resume``).

The watch covers ``trainer.train()`` (exports and saves in ``on_train_end`` included, whatever the callbacks'
order); :func:`watching` extends it to phases run after it, like the recipes' final evaluation and export.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_dist.callbacks import phases
from hf_dist.callbacks.extension import extend
from hf_dist.callbacks.phases import Phase
from hf_dist.callbacks.progress_board import ProgressBoard

logger = logging.getLogger("hf_dist")

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: the job may be restarted (resumes from its last complete checkpoint)
TIMEOUT_SHARE = 0.8  # allowances stay under this share of the process group's timeout
_WATCHING: list[HangWatchdogCallback | None] = [None]  # the watchdog of this process's training (its clock is one)


_DEFAULTS = {"factor": 10.0, "min_limit_s": 300.0, "first_limit_s": 1800.0}


class HangWatchdogCallback(TrainerCallback):
    """Ends a hung job with every rank's stacks (module docstring). ``factor`` x a phase's longest silence, at least
    ``min_limit_s``, is its allowance; ``first_limit_s`` until one instance of it finished; ``limit_s``: one fixed
    allowance for every phase; ``gather_s``: how long rank 0 waits for the other ranks' stack files."""

    def __init__(
        self,
        limit_s: float | None = None,
        *,
        factor: float = _DEFAULTS["factor"],
        min_limit_s: float = _DEFAULTS["min_limit_s"],
        first_limit_s: float = _DEFAULTS["first_limit_s"],
        gather_s: float = 10.0,
    ) -> None:
        given = {"limit_s": limit_s, "factor": factor, "min_limit_s": min_limit_s, "first_limit_s": first_limit_s}
        for name, value in given.items():
            if value is not None and not value > 0:
                default = f"the default {_DEFAULTS[name]:g}" if name in _DEFAULTS else "no fixed limit"
                raise ValueError(
                    f"HangWatchdogCallback({name}={value!r}): {name} must be a number > 0; pass one, or leave it out "
                    f"for {default}"
                )
        self.limit_s, self.factor, self.min_limit_s = limit_s, factor, min_limit_s
        self.first_limit_s, self.gather_s = first_limit_s, gather_s
        self.trainer = None  # set by attach(); else found at train begin
        self.clock = phases.CLOCK  # the phases of this process
        self.board: ProgressBoard | None = None  # made at the first watch
        self._out: Path | None = None
        self._timeout_s = math.inf
        self._step = 0
        self._owner = 0  # the thread that trains
        self._window = False  # a watching() block is open
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, **kwargs):
        self._arm(args, state.global_step)
        extend(self.trainer or phases.running_trainer())
        self.clock.start_training()
        self._start_thread()

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.beat()

    def on_substep_end(self, args, state, control, **kwargs):
        self.clock.beat()

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step
        self.clock.step_ended()

    def on_log(self, args, state, control, **kwargs):
        self.clock.beat()

    def on_prediction_step(self, args, state, control, **kwargs):
        self.clock.beat()

    def on_evaluate(self, args, state, control, **kwargs):
        self.clock.beat()

    def on_save(self, args, state, control, **kwargs):
        self.clock.beat()

    def on_train_end(self, args, state, control, **kwargs):
        # The thread goes on until train() returns: saves and exports in on_train_end are phases, still watched.
        self.clock.stop_training()

    # ------------------------------------------------------------------ the allowances
    def allowance(self, which: Phase | None) -> float:
        """Seconds of silence that count as no progress in phase ``which`` (inf outside any phase)."""
        if which is None:
            return math.inf
        if self.limit_s is not None:
            return self.limit_s
        longest = self.clock.longest.get(which)
        allowed = self.first_limit_s if longest is None else max(self.min_limit_s, self.factor * longest)
        return min(allowed, TIMEOUT_SHARE * self._timeout_s)

    # ------------------------------------------------------------------ the watch
    def _arm(self, args: Any, step: int) -> None:
        self._timeout_s = float(getattr(args, "ddp_timeout", None) or math.inf)
        if self.limit_s is not None and self.limit_s >= self._timeout_s:
            raise ValueError(
                f"HangWatchdogCallback(limit_s={self.limit_s}) is not under the process group's timeout "
                f"(ddp_timeout={self._timeout_s:.0f} s): a hung collective would time out first, with no stacks.\n"
                f"  Pass a limit under {self._timeout_s:.0f} s, or raise TrainingArguments(ddp_timeout=...)"
            )
        self._out = Path(args.output_dir) / "hang"
        self._step = step
        self._owner = threading.get_ident()
        _WATCHING[0] = self  # a thread of an earlier Trainer's watchdog stops
        if self.board is None:
            self.board = ProgressBoard.for_this_process()

    def _start_thread(self) -> None:
        self._stop_thread()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hf_dist-hang-watchdog", daemon=True)
        self._thread.start()

    def _stop_thread(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._stop.set()
            self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        try:
            while not self._stop.wait(min(1.0, self.allowance(self.clock.current) / 10)):
                if not self._active() or self._poll():
                    return
        finally:
            with contextlib.suppress(Exception):  # the store may be gone at the end of the job
                self.board.leave()

    def _active(self) -> bool:
        """Whether this is the process's watchdog, and the thread that trains is inside ``train()`` or a
        :func:`watching` block."""
        if _WATCHING[0] is not self:
            return False
        if self._window:
            return True
        frame = sys._current_frames().get(self._owner)
        while frame is not None:
            if frame.f_code.co_name == "_inner_training_loop":
                return True
            frame = frame.f_back
        return False

    def _poll(self) -> bool:
        """One check; when the run is hung, writes the stacks and ends the process. True when it ended the watch."""
        try:
            step = self.hung_step()
        except Exception as exc:  # the store went away (the job is ending): judge this rank alone
            logger.debug("hf_dist: hang watchdog store error: %s", exc)
            step = None if self.clock.silence() <= self.allowance(self.clock.current) else self._step
        if step is None:
            return False
        self._hung(step)
        return True

    def hung_step(self) -> int | None:
        """The step after which the run is hung (no rank makes progress within its phase's allowance), or None."""
        declared = self.board.declared()
        if declared is not None:
            return declared
        which = self.clock.current
        ok = which is not None and self.clock.silence() <= self.allowance(which)
        self.board.report(ok)
        if which is None or ok or self.board.anyone_ok(self.clock.clock()):
            return None  # outside any phase nothing is timed: this rank neither counts itself nor declares
        self.board.declare(self._step)
        return self._step

    def _hung(self, step: int) -> None:
        from hf_dist.runtime import dist as _dist

        rank, world = _dist.rank(), _dist.world_size()
        folder = self._out / str(step)
        which = self.clock.current
        header = stack_header(rank, which, self.clock.silence(), self.allowance(which), step)
        write_stacks(folder / f"rank{rank}.txt", header)
        if rank == 0:
            deadline = time.monotonic() + self.gather_s
            while time.monotonic() < deadline and len(list(folder.glob("rank*.txt"))) < world:
                time.sleep(0.2)
            logger.error("%s", summary(folder, world, step))
        else:
            time.sleep(min(self.gather_s, 2.0))  # let rank 0 read before the launcher tears the job down
        _exit_job(HANG_EXIT_CODE)

    @contextlib.contextmanager
    def window(self, args: Any, step: int) -> Iterator[None]:
        """Watch the phases run in this block outside ``train()``; see :func:`watching`."""
        self._arm(args, step)
        self._window = True
        self._start_thread()
        try:
            yield
        finally:
            self._window = False
            self._stop_thread()


@contextlib.contextmanager
def watching(trainer: Any) -> Iterator[None]:
    """Watch the phases (evaluation, export, save) that run in this block after ``trainer.train()`` returned, with
    the same allowances, when the trainer has a :class:`HangWatchdogCallback`; outside a phase nothing is timed.

        with watching(trainer):
            metrics = trainer.evaluate()
            export_model(trainer, ...)
    """
    watchdog = next((c for c in trainer.callback_handler.callbacks if isinstance(c, HangWatchdogCallback)), None)
    if watchdog is None:
        yield
        return
    extend(trainer)
    with watchdog.window(trainer.args, trainer.state.global_step):
        yield


def _exit_job(code: int) -> None:
    os._exit(code)


def stack_header(rank: int, which: Phase | None, silence: float, allowance: float, step: int) -> str:
    where = which.value if which is not None else "no phase"
    return f"rank {rank}: no progress in {where} for {silence:.1f} s (allowance {allowance:.1f} s) after step {step}"


_HEADER = re.compile(r"no progress in (?P<phase>.+?) for (?P<silence>[\d.]+) s \(allowance (?P<allowance>[\d.]+) s\)")


def write_stacks(path: Path, header: str) -> None:
    """``header``, then the Python stacks of every thread of this process, written to ``path`` whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(header + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    os.replace(tmp, path)  # complete or absent: rank 0 reads only finished files


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def innermost_frame(text: str) -> str:
    """``func at file:line`` of the innermost frame of the main thread in a faulthandler dump, or "?"."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    main = next((b for b in blocks if " in <module>" in b and " in _hung" not in b), "")  # the script's thread
    for line in main.splitlines():
        match = _FRAME.match(line)
        if match:
            where = f"{Path(match['file']).name}:{match['line']}"
            return f"{match['func']} at {where}"
    return "?"


def rank_line(text: str) -> str:
    """One rank's line of the summary, from its stack file: its phase, silence, allowance and main thread."""
    match = _HEADER.search(text.partition("\n")[0])
    phase = f"{match['phase']}, silent {match['silence']} s (allowance {match['allowance']} s); " if match else ""
    return f"{phase}main thread in {innermost_frame(text)}"


def summary(folder: Path, world: int, step: int) -> str:
    """One line per rank: its phase and where its main thread is, from the stack files in ``folder``."""
    lines = [f"hf_dist: the job hung after step {step}: no rank made progress within its phase's allowance. Ranks:"]
    for rank in range(world):
        path = folder / f"rank{rank}.txt"
        where = rank_line(path.read_text()) if path.is_file() else "no stack file (the rank did not answer)"
        lines.append(f"  rank {rank}: {where}")
    lines.append(
        f"  stacks of every thread: {folder}/rank<R>.txt. Exiting with code {HANG_EXIT_CODE}; the run resumes from "
        "its last complete checkpoint (hf_dist.auto_resume)."
    )
    return "\n".join(lines)
