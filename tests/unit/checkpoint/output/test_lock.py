"""One live job per output folder (issue 32 item 7): the lock names the job holding it, a dead job's lock is taken
over, and a rank whose launcher died stops instead of training on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hf_dist.checkpoint.formats.names import OUTPUT_LOCK
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.output import lock as output_lock
from hf_dist.checkpoint.output.lock import OutputBusyError, claim_output_dir, release_output_dir


@pytest.fixture
def other_job(tmp_path):
    """A live process of another job, and a lock in its name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    import psutil

    lock = {"host": socket.gethostname(), "pid": proc.pid, "process_start": psutil.Process(proc.pid).create_time(),
            "job": "elsewhere:29500:", "started": time.time() - 60, "heartbeat": time.time()}  # fmt: skip
    yield proc, lock
    proc.kill()
    proc.wait()


def _write(folder, lock) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / OUTPUT_LOCK).write_text(json.dumps(lock))


def test_a_job_holds_its_folder_and_claiming_again_is_a_no_op(tmp_path):
    claim_output_dir(tmp_path / "out")
    lock = json.loads((tmp_path / "out" / OUTPUT_LOCK).read_text())
    assert (lock["host"], lock["pid"]) == (socket.gethostname(), os.getpid())
    claim_output_dir(tmp_path / "out")
    auto_resume(tmp_path / "out")  # its own lock does not stop it
    release_output_dir(tmp_path / "out")
    assert not (tmp_path / "out" / OUTPUT_LOCK).exists()


def test_a_second_job_is_refused_naming_the_first(tmp_path, other_job):
    proc, lock = other_job
    _write(tmp_path / "out", lock)
    expected = rf"is being written by another job: host {socket.gethostname()}, pid {proc.pid}, started "
    with pytest.raises(OutputBusyError, match=expected):
        claim_output_dir(tmp_path / "out")
    with pytest.raises(OutputBusyError, match=expected + r".*not resuming from a folder another job is writing"):
        auto_resume(tmp_path / "out")
    assert json.loads((tmp_path / "out" / OUTPUT_LOCK).read_text())["pid"] == proc.pid  # untouched


def test_a_dead_jobs_lock_is_taken_over(tmp_path, other_job, caplog):
    proc, lock = other_job
    _write(tmp_path / "out", lock)
    proc.kill()
    proc.wait()
    with caplog.at_level("WARNING"):
        claim_output_dir(tmp_path / "out")
    assert f"from a job that is gone (host {socket.gethostname()}, pid {proc.pid}" in caplog.text
    assert json.loads((tmp_path / "out" / OUTPUT_LOCK).read_text())["pid"] == os.getpid()
    release_output_dir(tmp_path / "out")


def test_another_hosts_lock_counts_by_its_heartbeat(tmp_path, caplog):
    lock = {"host": "node-that-is-not-this-one", "pid": 1, "job": "n2:29500:", "started": time.time() - 600,
            "heartbeat": time.time() - 5}  # fmt: skip
    _write(tmp_path / "out", lock)
    with pytest.raises(OutputBusyError, match="host node-that-is-not-this-one, pid 1, .*last heartbeat 5 s ago"):
        claim_output_dir(tmp_path / "out")
    lock["heartbeat"] = time.time() - output_lock.STALE_S - 1
    _write(tmp_path / "out", lock)
    with caplog.at_level("WARNING"):
        claim_output_dir(tmp_path / "out")
    assert "taking over" in caplog.text
    release_output_dir(tmp_path / "out")


def test_attach_refuses_a_folder_another_job_writes(make_trainer, tmp_path, other_job):
    from hf_dist.callbacks import attach

    _, lock = other_job
    trainer = make_trainer(output_dir=str(tmp_path / "out"))
    _write(tmp_path / "out", lock)
    with pytest.raises(OutputBusyError, match="is being written by another job"):
        attach(trainer)


ORPHAN = """
import os, sys, time
from hf_dist.checkpoint.output import lock as output_lock
output_lock.ORPHAN_POLL_S = 0.2
output_lock.exit_with_launcher()
print(os.getpid(), flush=True)
time.sleep(60)
"""
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**__import__("os").environ, "LOCAL_RANK": "0"})
time.sleep(60)
"""


def test_a_rank_whose_launcher_is_killed_stops(tmp_path, capfd):
    """kill -9 of the launcher: its rank notices its parent is gone, says so and exits (its exit code goes to init,
    which adopted it: the message is what shows it was hf_dist's exit)."""
    import psutil

    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, ORPHAN], env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not psutil.Process(launcher.pid).children():
        time.sleep(0.1)
    (rank,) = psutil.Process(launcher.pid).children()
    time.sleep(1.0)  # the rank is up and watching
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    gone, alive = psutil.wait_procs([rank], timeout=30)
    assert gone and not alive, "the orphaned rank trained on"
    assert (
        f"its launcher (pid {launcher.pid}) is gone; stopping instead of training on alone" in capfd.readouterr().err
    )


# ---------------------------------------------------------------- issue 38: one identity per launch, taken exclusively

SAME_ENV = {
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}  # every single-node launch
RANK = """
import os, sys, time
import torch.distributed as dist
from hf_dist.checkpoint.output.lock import check_output_dir_free, claim_output_dir
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=int(os.environ["RANK"]), world_size=2)
claim_output_dir(sys.argv[1])
check_output_dir_free(sys.argv[1])  # rank 1: the lock rank 0 took is its own launch's
print("claimed", flush=True)
time.sleep(120)
"""


def _launch_ranks(tmp_path, out) -> list[subprocess.Popen]:
    """One launch of two real ranks (a gloo process group), both with the single-node launch environment."""
    env = {**os.environ, **SAME_ENV, "PYTHONPATH": os.getcwd(), "WORLD_SIZE": "2"}
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(out), str(tmp_path / "rendezvous")],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]


def test_two_launches_with_the_same_environment_never_share_the_lock(tmp_path, monkeypatch, caplog):
    """Launch A (two ranks) holds the folder; launch B, with the same MASTER_ADDR:MASTER_PORT:TORCHELASTIC_RUN_ID, is
    refused naming A's rank 0, while A's rank 1 was admitted by the identity rank 0 sent it."""
    for name, value in SAME_ENV.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    ranks = _launch_ranks(tmp_path, out)
    try:
        assert [rank.stdout.readline().strip() for rank in ranks] == ["claimed", "claimed"]
        holder = ranks[0].pid
        busy = rf"is being written by another job: host {socket.gethostname()}, pid {holder}, started "
        with pytest.raises(OutputBusyError, match=busy):
            claim_output_dir(out)
        with pytest.raises(OutputBusyError, match=busy):
            auto_resume(out)
        assert json.loads((out / OUTPUT_LOCK).read_text())["pid"] == holder
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    with caplog.at_level("WARNING"):
        claim_output_dir(out)  # launch A is gone: its lock is taken over, with a warning naming it
    assert f"from a job that is gone (host {socket.gethostname()}, pid {holder}" in caplog.text
    release_output_dir(out)


AHEAD = """
import os, sys
from pathlib import Path
import torch.distributed as dist
from hf_dist.checkpoint.output import lock as output_lock
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
if rank == 0:
    assert output_lock._take(Path(sys.argv[1])) is None  # rank 0 already holds the lock (attach ran there first)
dist.barrier()
output_lock.check_output_dir_free(sys.argv[1])
print("free", flush=True)
"""


def test_a_rank_asking_after_its_rank_0_took_the_lock_is_not_refused(tmp_path):
    """auto_resume's check on rank 1 while rank 0 of the same launch already holds the lock (rank 1 has not yet been
    sent the launch's identity): rank 0 answers for every rank, so neither is refused (it once refused rank 1 in a
    ZeRO-Infinity resume, naming its own rank 0)."""
    env = {**os.environ, **SAME_ENV, "PYTHONPATH": os.getcwd(), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", AHEAD, str(tmp_path / "out"), str(tmp_path / "rendezvous")],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    results = [rank.communicate(timeout=120) for rank in ranks]
    assert [out.strip() for out, _ in results] == ["free", "free"], results


def test_the_lock_file_is_created_exclusively(tmp_path, other_job, monkeypatch):
    """Two jobs that both found the folder free: the second's exclusive create fails, it looks again and is refused
    naming the first, whose lock stays as it was."""
    proc, lock = other_job
    real = output_lock._current
    looks = []

    def racing(path):
        looks.append(path)
        if len(looks) == 1:  # no lock yet; the other job creates it right after this look
            _write(tmp_path / "out", lock)
            return None
        return real(path)

    monkeypatch.setattr(output_lock, "_current", racing)
    with pytest.raises(OutputBusyError, match=rf"pid {proc.pid}, started "):
        claim_output_dir(tmp_path / "out")
    assert json.loads((tmp_path / "out" / OUTPUT_LOCK).read_text()) == lock


def test_a_lock_of_this_pid_but_another_start_time_is_a_dead_jobs(tmp_path, caplog):
    """A recycled pid: the lock names this process's pid, but a process that started earlier; it is taken over."""
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": 1.0, "launch": "an-old-launch",
            "started": time.time() - 600, "heartbeat": time.time()}  # fmt: skip
    _write(tmp_path / "out", lock)
    with caplog.at_level("WARNING"):
        claim_output_dir(tmp_path / "out")
    assert "taking over" in caplog.text
    assert json.loads((tmp_path / "out" / OUTPUT_LOCK).read_text())["process_start"] != 1.0
    release_output_dir(tmp_path / "out")


def test_an_unreadable_lock_is_live_until_it_is_stale(tmp_path, caplog):
    """An empty lock (a job between its exclusive create and its write, or one that died there)."""
    path = tmp_path / "out" / OUTPUT_LOCK
    _write(tmp_path / "out", {})
    path.write_text("")
    with pytest.raises(OutputBusyError, match="an unreadable lock, last written 0 s ago"):
        claim_output_dir(tmp_path / "out")
    old = time.time() - output_lock.STALE_S - 1
    os.utime(path, (old, old))
    with caplog.at_level("WARNING"):
        claim_output_dir(tmp_path / "out")
    assert "taking over" in caplog.text and json.loads(path.read_text())["pid"] == os.getpid()
    release_output_dir(tmp_path / "out")
