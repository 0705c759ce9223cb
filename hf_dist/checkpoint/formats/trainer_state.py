"""A checkpoint's ``trainer_state.json`` (the Trainer writes it after every other file of a save), read in one place:
the layout reader, the proof of a complete checkpoint, ``auto_resume`` and the finished-run check all ask this module
for a checkpoint's step and its run's length instead of parsing the file themselves."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hf_dist.checkpoint.formats.names import TRAINER_STATE
from hf_dist.checkpoint.safety.paths import ConfinedFolder, PathEscapeError

# far more than any real trainer_state.json (a log entry per logging step: a few MB for a million steps); a larger file
# is refused before it is read into memory
MAX_BYTES = 256 * 1024**2


class TrainerStateError(ValueError):
    """Why a checkpoint's ``trainer_state.json`` cannot say its step: missing, unreadable, or no step in it."""


def read_trainer_state(folder: str | os.PathLike) -> dict[str, Any]:
    """``folder``'s ``trainer_state.json`` as a JSON object whose ``global_step`` is a step (an int >= 0), or a
    :class:`TrainerStateError` saying what is wrong, in words a skipped checkpoint's reason can hold."""
    try:
        path = ConfinedFolder(Path(folder)).path(TRAINER_STATE)  # a link out of the checkpoint is refused
    except PathEscapeError as exc:
        raise TrainerStateError(str(exc)) from None
    if not path.is_file():
        raise TrainerStateError(
            f"{TRAINER_STATE} is missing (the Trainer writes it after every other file of the save)"
        )
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise TrainerStateError(f"{TRAINER_STATE} is unreadable ({exc})") from None
    if size > MAX_BYTES:
        raise TrainerStateError(f"{TRAINER_STATE} is {size:,} bytes, over the {MAX_BYTES:,} a Trainer writes")
    try:
        data = json.loads(path.read_text())
    except (
        OSError,
        ValueError,
        RecursionError,
    ) as exc:  # bad JSON or UTF-8, an int past Python's digit limit, nesting
        raise TrainerStateError(f"{TRAINER_STATE} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise TrainerStateError(f"{TRAINER_STATE} is unreadable (a JSON {type(data).__name__}, not an object)")
    step = data.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise TrainerStateError(f"{TRAINER_STATE} says global_step {step!r}, not a step")
    return data


def saved_step(folder: str | os.PathLike) -> int | None:
    """The step ``folder`` was saved at by its ``trainer_state.json``; None when the file cannot say it."""
    try:
        return read_trainer_state(folder)["global_step"]
    except TrainerStateError:
        return None
