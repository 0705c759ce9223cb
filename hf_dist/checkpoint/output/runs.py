"""Which run a checkpoint belongs to: the run journal of an output folder and the lineage rule auto_resume applies.

A run that trains in ``output_dir`` under hf_dist's callbacks records itself in ``hf_dist_run.json`` when training
starts (rank 0): its id, the step it started from and the checkpoint (and run) it resumed. Every manifest it writes
carries its id (:mod:`hf_dist.checkpoint.lifecycle.manifest`). When a user rolls back (resumes checkpoint-2 while
checkpoint-4 and checkpoint-6 of the first run are still there), the journal says the current run started at step 2:
checkpoints after step 2 belong to it only, and the first run's are skipped, named, instead of resumed as if they
continued the second (:func:`lineage_reason`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_dist.atomic_io import atomic_write_json
from hf_dist.checkpoint.formats.names import RUN_JOURNAL


@dataclass(frozen=True)
class RunRecord:
    """One training run in an output folder, as its journal records it."""

    run: str
    start_step: int
    resumed_from: str | None = None  # the checkpoint folder it resumed (a name in the output folder, or a path)
    parent_run: str | None = None  # the run that wrote that checkpoint, when its manifest says
    host: str = ""
    pid: int = 0
    started: float = 0.0


def begin_run(output_dir: str | os.PathLike, run: str, *, start_step: int, resumed_from: str | None,
              parent_run: str | None) -> RunRecord:  # fmt: skip
    """Rank 0 at train start: record ``run`` as the one training in ``output_dir`` now."""
    record = RunRecord(run, start_step, resumed_from, parent_run, socket.gethostname(), os.getpid(), time.time())
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(output_dir) / RUN_JOURNAL, asdict(record))
    return record


def read_run(output_dir: str | os.PathLike) -> RunRecord | None:
    """The run that last started training in ``output_dir``; None without a (readable) journal."""
    path = Path(output_dir) / RUN_JOURNAL
    try:
        data = json.loads(path.read_text())
        return RunRecord(**{k: data[k] for k in RunRecord.__dataclass_fields__ if k in data})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def lineage_reason(record: RunRecord | None, step: int, run: str | None) -> str | None:
    """Why checkpoint ``step`` (whose manifest names ``run``, None without one) is not part of the run that last
    trained in the folder; None when it is (or there is no journal to tell)."""
    if record is None or step <= record.start_step or run == record.run:
        return None
    origin = f"{record.resumed_from} (step {record.start_step})" if record.resumed_from else "scratch"
    written = f"run {run}" if run else "a save without a manifest"
    return (
        f"written by {written}, not by run {record.run}, which last trained in this folder starting from {origin}: "
        f"a checkpoint after step {record.start_step} can only be that run's"
    )
