"""One live job per output folder: a lock naming the job that writes there, and ranks that stop with their launcher.

Two jobs training into one ``output_dir`` interleave checkpoints, resume each other's saves and die in a gloo error
that points at neither. :func:`claim_output_dir` (collective; ``attach``, ``auto_resume`` and the recipes call it
before training) makes rank 0 hold ``output_dir/hf_dist_lock.json``, created exclusively (``O_EXCL``): host, pid, the
process's start time, the launch's identity (a random token rank 0 makes and sends every rank), the launch time and a
heartbeat rewritten every :data:`HEARTBEAT_S`. A second job finds it and is refused on every rank, naming the first
(host, pid, start time), even with the same environment (every single-node launch has ``127.0.0.1:29500``). Liveness
comes first: a lock whose job is gone (same host: that pid no longer runs the process that started then; another
host: no heartbeat for :data:`STALE_S`) is taken over, with a warning naming the dead job; only a live lock can be
this launch's own.

A rank whose launcher was killed (``kill -9`` of ``torchrun`` / ``accelerate launch``) would train on as an orphan and
keep writing the folder: :func:`exit_with_launcher` stops it within :data:`ORPHAN_POLL_S` seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

from hf_dist.atomic_io import atomic_write_json
from hf_dist.checkpoint.formats.names import OUTPUT_LOCK

logger = logging.getLogger(__name__)

HEARTBEAT_S = 15.0  # how often the holder rewrites its heartbeat
STALE_S = 90.0  # a lock of another host with no heartbeat for this long belongs to a dead job
ORPHAN_POLL_S = 2.0  # how often a launched rank checks its launcher is still there
ORPHAN_EXIT_CODE = 70

_HELD: dict[str, dict] = {}  # output_dir (resolved) -> the lock record this process holds
_LAUNCH: dict[str, str] = {}  # "id": this launch's identity (_own_launch), once made or received from rank 0
_LOCK = threading.Lock()


class OutputBusyError(RuntimeError):
    """Another live job is writing the output folder."""


def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, ValueError):
        return None


def _own_launch() -> str:
    """This launch's identity: a random token made once by rank 0; every other rank holds the one rank 0 sent it
    (:func:`claim_output_dir`). Two launches never share it, whatever their environment (every single-node
    ``torchrun`` has ``MASTER_ADDR:MASTER_PORT`` = ``127.0.0.1:29500``)."""
    return _LAUNCH.setdefault("id", secrets.token_hex(16))


def _record() -> dict[str, Any]:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
            "launch": _own_launch(), "started": now, "heartbeat": now}  # fmt: skip


def _alive(lock: dict) -> bool:
    """Whether the job a lock names still runs: by pid and process start on this host, by heartbeat elsewhere."""
    if lock.get("host") == socket.gethostname():
        start = _process_start(_int(lock.get("pid")))
        return start is not None and (lock.get("process_start") is None or abs(start - lock["process_start"]) < 1.0)
    return time.time() - _float(lock.get("heartbeat")) < STALE_S


def _is_mine(lock: dict) -> bool:
    """A live lock is this launch's: taken by this very process (host, pid and start time), or by rank 0 of this
    launch (its token). Asked only after :func:`_alive`: a dead job's lock is never anyone's."""
    same_process = (lock.get("host"), _int(lock.get("pid"))) == (socket.gethostname(), os.getpid()) and _float(
        lock.get("process_start")) == _float(_process_start(os.getpid()))  # fmt: skip
    return same_process or ("id" in _LAUNCH and lock.get("launch") == _LAUNCH["id"])


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def _float(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _describe(lock: dict) -> str:
    beat = time.time() - _float(lock.get("heartbeat"))
    if lock.get("unreadable"):
        return f"an unreadable lock, last written {beat:.0f} s ago (a job writing it, or one that died doing so)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_float(lock.get("started"))))
    return f"host {lock.get('host')}, pid {lock.get('pid')}, started {started} (last heartbeat {beat:.0f} s ago)"


def _current(path: Path) -> dict | None:
    """The lock at ``path``, None when there is none. One that cannot be parsed (a job between creating and writing
    it, or one that died there) is a lock of an unknown job whose heartbeat is the file's last change."""
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            return data
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        pass
    try:
        changed = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return {"host": None, "pid": None, "heartbeat": changed, "started": changed, "unreadable": True}


def _busy(output_dir: Path, lock: dict, path: Path) -> str:
    return (
        f"{output_dir} is being written by another job: {_describe(lock)}. Two jobs in one output folder "
        f"interleave their checkpoints; wait for it to end or stop it, or use another output_dir (its lock: {path})"
    )


def _take(output_dir: Path) -> str | None:
    """Rank 0: hold the lock of ``output_dir`` (created exclusively), or the refusal naming the live job holding it."""
    path = output_dir / OUTPUT_LOCK
    output_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        current = _current(path)
        if current is not None and _alive(current):
            if not _is_mine(current):
                return _busy(output_dir, current, path)
            _hold(output_dir, path, exclusive=False)  # this launch's own lock, written again with this process
            return None
        if current is not None:
            if not _set_aside(path, current):
                continue  # not the lock judged dead any more: look again
            logger.warning("hf_dist: taking over %s from a job that is gone (%s)", path, _describe(current))
        if _hold(output_dir, path, exclusive=True):
            return None
    return f"{output_dir}: its lock {path} kept changing while hf_dist took it (jobs starting together); retry"


def _set_aside(path: Path, dead: dict) -> bool:
    """Remove a dead job's lock, only if it is still that lock (False: another job's replaced it, look again)."""
    aside = path.with_name(f".{path.name}.{secrets.token_hex(4)}.dead")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return True
    if _current(aside) == dead:
        aside.unlink()
        return True
    with contextlib.suppress(FileExistsError):
        os.link(aside, path)  # a live lock that replaced the dead one: put it back
    aside.unlink(missing_ok=True)
    return False


def _hold(output_dir: Path, path: Path, *, exclusive: bool) -> bool:
    """Write this process's record as the lock (``exclusive``: created with O_EXCL, False when one appeared)."""
    record = _record()
    if exclusive:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(record))
            handle.flush()
            os.fsync(handle.fileno())
    else:
        atomic_write_json(path, record)
    _HELD[str(output_dir.resolve())] = record
    _start_heartbeat(output_dir)
    return True


def check_output_dir_free(output_dir: str | os.PathLike) -> None:
    """Raise :class:`OutputBusyError` on every rank when another live job holds ``output_dir``'s lock (reads only).

    Collective under a process group: rank 0 judges and sends its answer, since only it knows this launch's identity
    before :func:`claim_output_dir` sends it (rank 0 may already hold the lock while another rank asks). Without one,
    only the launcher's rank 0 (``RANK``) judges."""
    from hf_dist.runtime import dist as _dist

    rank = _dist.rank() if _dist.is_distributed() else int(os.environ.get("RANK") or 0)
    refusal = _refusal_to_resume(Path(output_dir)) if rank == 0 else None
    refusal = _dist.broadcast_object(refusal)
    if refusal:
        raise OutputBusyError(refusal)


def _refusal_to_resume(output_dir: Path) -> str | None:
    path = output_dir / OUTPUT_LOCK
    current = _current(path)
    if current is not None and _alive(current) and not _is_mine(current):
        return (
            f"{output_dir} is being written by another job: {_describe(current)}; not resuming from a folder another "
            f"job is writing. Wait for it to end or stop it, or use another output_dir (its lock: {path})"
        )
    return None


def claim_output_dir(output_dir: str | os.PathLike) -> None:
    """Collective: rank 0 takes ``output_dir``'s lock (idempotent) and sends every rank its answer and this launch's
    identity (:func:`_own_launch`); when another live job holds the lock, every rank raises :class:`OutputBusyError`
    naming that job. Also stops this rank if its launcher dies (:func:`exit_with_launcher`).

    Without a process group only the launcher's rank 0 (``RANK``) takes the lock; the other ranks cannot learn this
    launch's identity and leave it to rank 0."""
    from hf_dist.runtime import dist as _dist

    folder = Path(output_dir)
    answer = None
    rank = _dist.rank() if _dist.is_distributed() else int(os.environ.get("RANK") or 0)
    if rank == 0:
        with _LOCK:
            refusal = None if str(folder.resolve()) in _HELD else _take(folder)
        answer = (refusal, _own_launch())
    answer = _dist.broadcast_object(answer)
    if answer is not None:
        refusal, _LAUNCH["id"] = answer
        if refusal:
            raise OutputBusyError(refusal)
    exit_with_launcher()


def release_output_dir(output_dir: str | os.PathLike) -> None:
    """Drop this process's lock of ``output_dir`` (at exit, or when training there is over)."""
    key = str(Path(output_dir).resolve())
    with _LOCK:
        record = _HELD.pop(key, None)
    path = Path(output_dir) / OUTPUT_LOCK
    current = _current(path)
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
