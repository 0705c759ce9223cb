"""HangWatchdogCallback: a hung job ends in minutes with every rank's stacks, not after the distributed timeout.

A thread on every rank watches the Trainer's progress events (step begin and end, log, save, evaluate). When none
comes within the limit, every rank writes the Python stacks of all its threads to
``<output_dir>/hang/<step>/rank<R>.txt``; rank 0 waits a moment for the others' files and prints, for each rank,
the innermost frame its main thread is in ("rank 0 waits in all_reduce at ...; rank 1 is in sleep at ..."), then
every rank exits with :data:`HANG_EXIT_CODE`. The run resumes from its last complete checkpoint
(``hf_dist.auto_resume``).

The limit: ``limit_s`` when given, else ``factor`` times the longest interval of the same kind seen so far (a step,
a save, an evaluation: the Trainer's flow says at each step's end whether a save or an evaluation follows), at least
``min_limit_s``; ``first_limit_s`` for the first of each kind (the first step's compilation, the first save). It
is always under the process group's timeout (``TrainingArguments.ddp_timeout``); a limit at or above it is refused,
since the collective would time out first with no stacks.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger("hf_dist")

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: the job may be restarted (resumes from its last complete checkpoint)


class HangWatchdogCallback(TrainerCallback):
    def __init__(
        self,
        limit_s: float | None = None,
        *,
        factor: float = 10.0,
        min_limit_s: float = 300.0,
        first_limit_s: float = 1800.0,
        gather_s: float = 10.0,
    ) -> None:
        for name, value in (("limit_s", limit_s), ("min_limit_s", min_limit_s), ("first_limit_s", first_limit_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.limit_s, self.factor, self.min_limit_s = limit_s, factor, min_limit_s
        self.first_limit_s, self.gather_s = first_limit_s, gather_s
        self._last = 0.0
        self._longest = {"step": 0.0, "save": 0.0, "evaluate": 0.0}  # per kind of work between two events
        self._pending: list[str] = []  # what follows this step's end: "evaluate", "save" (the Trainer's order)
        self._step = 0
        self._out: Path | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._timeout_s = float("inf")
        self._trainer_thread = 0

    # ------------------------------------------------------------------ Trainer events
    def on_train_begin(self, args, state, control, **kwargs):
        self._timeout_s = float(getattr(args, "ddp_timeout", None) or float("inf"))
        if self.limit_s is not None and self.limit_s >= self._timeout_s:
            raise ValueError(
                f"HangWatchdogCallback(limit_s={self.limit_s}) is not under the process group's timeout "
                f"(ddp_timeout={self._timeout_s:.0f} s): a hung collective would time out first, with no stacks.\n"
                f"  Pass a limit under {self._timeout_s:.0f} s, or raise TrainingArguments(ddp_timeout=...)"
            )
        self._out = Path(args.output_dir) / "hang"
        self._step = state.global_step
        self._progress(None)
        self._stop.clear()
        self._trainer_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="hf_dist-hang-watchdog", daemon=True)
        self._thread.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self._progress("step")

    def on_step_end(self, args, state, control, **kwargs):
        self._progress("step")
        self._step = state.global_step
        self._pending = [k for k, on in (("evaluate", control.should_evaluate), ("save", control.should_save)) if on]

    def on_log(self, args, state, control, **kwargs):
        self._progress(None)

    def on_evaluate(self, args, state, control, **kwargs):
        self._progress("evaluate")

    def on_save(self, args, state, control, **kwargs):
        self._progress("save")

    def on_train_end(self, args, state, control, **kwargs):
        self._stop.set()

    # ------------------------------------------------------------------ the watch
    def _progress(self, kind: str | None) -> None:
        """An event that ends work of ``kind`` (None: bookkeeping, e.g. a log) since the previous event."""
        now = time.monotonic()
        if kind == "step" and self._step == 0:
            kind = None  # the first step (compilation, warm-up) sets no pace
        if kind is not None and self._last:
            self._longest[kind] = max(self._longest[kind], now - self._last)
        if kind in self._pending:
            self._pending.remove(kind)
        self._last = now

    def limit(self) -> float:
        """Seconds without progress that count as a hang for the work under way, always under the process group's
        timeout."""
        if self.limit_s is not None:
            return self.limit_s
        longest = self._longest[self._pending[0] if self._pending else "step"]
        limit = self.first_limit_s if longest == 0 else max(self.min_limit_s, self.factor * longest)
        return min(limit, 0.8 * self._timeout_s)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit() / 10)):
            if not self._training():  # train() ended by an exception (no on_train_end): nothing to watch
                return
            if time.monotonic() - self._last > self.limit():
                self._hung()
                return

    def _training(self) -> bool:
        """Whether the thread that began training is still inside the Trainer's training loop."""
        frame = sys._current_frames().get(self._trainer_thread)
        while frame is not None:
            if frame.f_code.co_name == "_inner_training_loop":
                return True
            frame = frame.f_back
        return False

    def _hung(self) -> None:
        from hf_dist.runtime import dist as _dist

        rank, world = _dist.rank(), _dist.world_size()
        folder = self._out / str(self._step)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}.txt"
        with open(path.with_suffix(".tmp"), "w") as f:
            f.write(f"rank {rank}: no progress for {self.limit():.0f} s after step {self._step}\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(path.with_suffix(".tmp"), path)  # complete or absent: rank 0 reads only finished files
        if rank == 0:
            deadline = time.monotonic() + self.gather_s
            while time.monotonic() < deadline and len(list(folder.glob("rank*.txt"))) < world:
                time.sleep(0.2)
            logger.error("%s", summary(folder, world, self.limit(), self._step))
        else:
            time.sleep(min(self.gather_s, 2.0))  # let rank 0 read before the launcher tears the job down
        os._exit(HANG_EXIT_CODE)


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


def summary(folder: Path, world: int, limit: float, step: int) -> str:
    """One line per rank: where its main thread is, from the stack files in ``folder``."""
    lines = [f"hf_dist: the job hung after step {step}: no progress for {limit:.0f} s on rank 0. Main threads:"]
    for rank in range(world):
        path = folder / f"rank{rank}.txt"
        where = innermost_frame(path.read_text()) if path.is_file() else "no stack file (the rank did not answer)"
        lines.append(f"  rank {rank}: {where}")
    lines.append(
        f"  stacks of every thread: {folder}/rank<R>.txt. Exiting with code {HANG_EXIT_CODE}; the run resumes from "
        "its last complete checkpoint (hf_dist.auto_resume)."
    )
    return "\n".join(lines)
