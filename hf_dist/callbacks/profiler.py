"""ProfilerCallback: a torch.profiler trace of a window of steps and the share of time in communication."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_dist.callbacks.memory import _add_to_logs

logger = logging.getLogger(__name__)

# Collective ops as they appear in profiles: c10d ops, gloo/NCCL kernels, DeepSpeed/FSDP wrappers.
COMM_PATTERN = re.compile(r"allreduce|all_reduce|all_gather|allgather|reduce_scatter|broadcast|c10d|nccl|gloo", re.I)


def comm_time_us(events: Any, *, device: bool = False) -> float:
    """Self time (µs) of communication events in ``prof.key_averages()``; self time avoids double counting."""
    total = 0.0
    for event in events:
        if COMM_PATTERN.search(event.key):
            total += event.self_device_time_total if device else event.self_cpu_time_total
    return total


class ProfilerCallback(TrainerCallback):
    """Profiles steps ``[start_step, start_step + num_steps)`` on ``ranks`` and writes
    ``OUTPUT_DIR/profiler/rank{R}.<time>.pt.trace.json`` — open it in chrome://tracing / Perfetto, or
    point TensorBoard's profiler plugin at the folder. Adds ``profiler/comm_share`` (communication
    self time / window wall time, on this rank) to the next log and to ``summary_rank{R}.json``.
    """

    def __init__(
        self,
        start_step: int = 2,
        num_steps: int = 3,
        *,
        output_dir: str | None = None,
        ranks: tuple[int, ...] = (0,),
        record_shapes: bool = False,
    ) -> None:
        if start_step < 0 or num_steps < 1:
            raise ValueError(
                f"need start_step >= 0 and num_steps >= 1, got start_step={start_step}, num_steps={num_steps}"
            )
        self.start_step = start_step
        self.num_steps = num_steps
        self.output_dir = output_dir
        self.ranks = tuple(ranks)
        self.record_shapes = record_shapes
        self.comm_share: float | None = None
        self.trace_path: str | None = None
        self._prof = None
        self._t0 = 0.0
        self._pending: dict[str, float] = {}

    def _rank(self, args: Any) -> int:
        return int(getattr(args, "process_index", 0))

    def on_step_begin(self, args, state, control, **kwargs):
        if self._prof is None and state.global_step == self.start_step and self._rank(args) in self.ranks:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities, record_shapes=self.record_shapes)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._prof is not None and state.global_step >= self.start_step + self.num_steps:
            self._finish(args)

    def on_train_end(self, args, state, control, **kwargs):
        if self._prof is not None:  # training ended inside the window
            self._finish(args)

    def _finish(self, args: Any) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - self._t0) * 1e6
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        rank = self._rank(args)
        folder = Path(self.output_dir or os.path.join(args.output_dir, "profiler"))
        folder.mkdir(parents=True, exist_ok=True)
        self.trace_path = str(folder / f"rank{rank}.{time.time_ns()}.pt.trace.json")
        prof.export_chrome_trace(self.trace_path)
        comm = comm_time_us(prof.key_averages(), device=torch.cuda.is_available())
        self.comm_share = min(comm / wall_us, 1.0) if wall_us > 0 else 0.0
        summary = {
            "rank": rank,
            "steps": self.num_steps,
            "wall_us": wall_us,
            "comm_us": comm,
            "comm_share": self.comm_share,
        }
        (folder / f"summary_rank{rank}.json").write_text(json.dumps(summary, indent=1))
        self._pending = {"profiler/comm_share": round(self.comm_share, 4)}
        logger.info(
            "hf_dist profiler: rank %d trace %s, communication %.1f%% of step time",
            rank,
            self.trace_path,
            100 * self.comm_share,
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._pending:
            _add_to_logs(state, logs, self._pending)
            self._pending = {}
