"""One live job per output folder: a lock naming the job that writes there, and ranks that stop with their launcher.

Two jobs training into one ``output_dir`` interleave checkpoints, resume each other's saves and die in a gloo error
that points at neither. :func:`claim_output_dir` (collective; ``attach``, ``auto_resume`` and the recipes call it
before training) makes rank 0 hold ``output_dir/hf_dist_lock.json``: host, pid, the process's start time, the
launch time and a heartbeat rewritten every :data:`HEARTBEAT_S`. A second job finds it and is refused on every rank,
naming the first (host, pid, start time). A lock whose job is gone (same host: that pid no longer runs that process;
another host: no heartbeat for :data:`STALE_S`) is taken over, with a warning naming the dead job.

A rank whose launcher was killed (``kill -9`` of ``torchrun`` / ``accelerate launch``) would train on as an orphan and
keep writing the folder: :func:`exit_with_launcher` stops it within :data:`ORPHAN_POLL_S` seconds.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_write_json
from hf_dist.checkpoint.formats.layout import OUTPUT_LOCK

logger = logging.getLogger(__name__)

HEARTBEAT_S = 15.0  # how often the holder rewrites its heartbeat
STALE_S = 90.0  # a lock of another host with no heartbeat for this long belongs to a dead job
ORPHAN_POLL_S = 2.0  # how often a launched rank checks its launcher is still there
ORPHAN_EXIT_CODE = 70

_HELD: dict[str, dict] = {}  # output_dir (resolved) -> the lock record this process holds
_LOCK = threading.Lock()


class OutputBusyError(RuntimeError):
    """Another live job is writing the output folder."""


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def _job() -> str:
    """What every rank of one launched job shares (its rendezvous), else this process."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}:{run}"
    return f"{socket.gethostname()}:{os.getpid()}"


def _record() -> dict[str, Any]:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
            "job": _job(), "started": now, "heartbeat": now}  # fmt: skip


def _alive(lock: dict) -> bool:
    """Whether the job a lock names still runs: by pid and process start on this host, by heartbeat elsewhere."""
    if lock.get("host") == socket.gethostname():
        start = _process_start(int(lock.get("pid", -1)))
        return start is not None and (lock.get("process_start") is None or abs(start - lock["process_start"]) < 1.0)
    return time.time() - float(lock.get("heartbeat", 0)) < STALE_S


def _describe(lock: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(lock.get("started", 0))))
    beat = time.time() - float(lock.get("heartbeat", 0))
    return f"host {lock.get('host')}, pid {lock.get('pid')}, started {started} (last heartbeat {beat:.0f} s ago)"


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _take(output_dir: Path) -> str | None:
    """Rank 0: hold the lock of ``output_dir``, or the refusal naming the live job that holds it."""
    path = output_dir / OUTPUT_LOCK
    current = _read(path)
    if current is not None and _alive(current) and not _is_mine(current):
        return (  # a live lock of another job
            f"{output_dir} is being written by another job: {_describe(current)}. Two jobs in one output folder "
            f"interleave their checkpoints; wait for it to end or stop it, or use another output_dir (its lock: {path})"
        )
    if current is not None and not _is_mine(current):
        logger.warning("hf_dist: taking over %s from a job that is gone (%s)", path, _describe(current))
    record = _record()
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)
    _HELD[str(output_dir.resolve())] = record
    _start_heartbeat(output_dir)
    return None


def _is_mine(lock: dict) -> bool:
    """The lock is this job's: taken by this process, or by rank 0 of the same launched job."""
    same_process = lock.get("host") == socket.gethostname() and int(lock.get("pid", -1)) == os.getpid()
    return same_process or lock.get("job") == _job()


def check_output_dir_free(output_dir: str | os.PathLike) -> None:
    """Raise :class:`OutputBusyError` when another live job holds ``output_dir``'s lock (reads only; every rank)."""
    path = Path(output_dir) / OUTPUT_LOCK
    current = _read(path)
    if current is not None and _alive(current) and not _is_mine(current):
        raise OutputBusyError(
            f"{output_dir} is being written by another job: {_describe(current)}; not resuming from a folder another "
            f"job is writing. Wait for it to end or stop it, or use another output_dir (its lock: {path})"
        )


def claim_output_dir(output_dir: str | os.PathLike) -> None:
    """Collective: rank 0 takes ``output_dir``'s lock (idempotent); when another live job holds it, every rank raises
    :class:`OutputBusyError` naming that job. Also stops this rank if its launcher dies (:func:`exit_with_launcher`)."""
    from hf_dist.runtime import dist as _dist

    folder = Path(output_dir)
    refusal = None
    if _dist.rank() == 0:
        with _LOCK:
            refusal = None if str(folder.resolve()) in _HELD else _take(folder)
    refusal = _dist.gather_objects(refusal)[0]
    if refusal:
        raise OutputBusyError(refusal)
    exit_with_launcher()


def release_output_dir(output_dir: str | os.PathLike) -> None:
    """Drop this process's lock of ``output_dir`` (at exit, or when training there is over)."""
    key = str(Path(output_dir).resolve())
    with _LOCK:
        record = _HELD.pop(key, None)
    path = Path(output_dir) / OUTPUT_LOCK
    current = _read(path)
    if record is not None and current is not None and _is_mine(current):
        path.unlink(missing_ok=True)


def _release_all() -> None:
    for key in list(_HELD):
        release_output_dir(key)


atexit.register(_release_all)


def _start_heartbeat(output_dir: Path) -> None:
    def beat() -> None:
        key = str(output_dir.resolve())
        while True:
            time.sleep(HEARTBEAT_S)
            with _LOCK:
                record = _HELD.get(key)
                if record is None:
                    return
                record["heartbeat"] = time.time()
                try:
                    atomic_write_json(output_dir / OUTPUT_LOCK, record)
                except OSError:  # the folder went away: nothing left to hold
                    _HELD.pop(key, None)
                    return

    threading.Thread(target=beat, name="hf_dist-output-lock", daemon=True).start()


# ---------------------------------------------------------------- orphans

_WATCHING = False


def exit_with_launcher() -> None:
    """In a rank started by a launcher (``torchrun``, ``accelerate launch``: ``LOCAL_RANK`` is set), a daemon thread
    checks every :data:`ORPHAN_POLL_S` that the launcher (this process's parent) is still there; when it is gone,
    the rank logs why and exits with :data:`ORPHAN_EXIT_CODE` instead of training on as an orphan."""
    global _WATCHING
    if _WATCHING or "LOCAL_RANK" not in os.environ:
        return
    _WATCHING = True
    launcher = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(ORPHAN_POLL_S)
            if os.getppid() != launcher:
                logger.error(
                    "hf_dist: rank %s: its launcher (pid %d) is gone; stopping instead of training on alone",
                    os.environ.get("RANK", "?"), launcher,
                )  # fmt: skip
                os._exit(ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name="hf_dist-launcher-watch", daemon=True).start()
