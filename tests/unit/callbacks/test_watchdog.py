"""HangWatchdogCallback's limit, refusal and stack reading (the hang itself: tests/distributed/test_hang.py)."""

from __future__ import annotations

import faulthandler
from types import SimpleNamespace

import pytest

from hf_dist.callbacks.watchdog import HangWatchdogCallback, innermost_frame


def _args(tmp_path, ddp_timeout=1800):
    return SimpleNamespace(output_dir=str(tmp_path), ddp_timeout=ddp_timeout)


def test_a_limit_at_or_above_the_process_group_timeout_is_refused(tmp_path):
    watchdog = HangWatchdogCallback(limit_s=1800)
    with pytest.raises(ValueError, match=r"(?s)limit_s=1800\) is not under the process group's timeout.*ddp_timeout"):
        watchdog.on_train_begin(_args(tmp_path), SimpleNamespace(global_step=0), None)
    with pytest.raises(ValueError, match="limit_s must be > 0 seconds"):
        HangWatchdogCallback(limit_s=0)


def test_the_limit_follows_the_longest_work_of_its_kind_and_stays_under_the_timeout():
    watchdog = HangWatchdogCallback(factor=10, min_limit_s=300, first_limit_s=1800)
    watchdog._timeout_s = 1000
    assert watchdog.limit() == 800  # before a step ends: first_limit_s, capped at 0.8 of the timeout
    watchdog._longest["step"] = 5
    assert watchdog.limit() == 300  # 10 x 5 s, at least min_limit_s
    watchdog._longest["step"] = 60
    assert watchdog.limit() == 600
    # a save follows this step's end: the first save gets first_limit_s, later ones 10x the longest save
    control = SimpleNamespace(should_evaluate=False, should_save=True)
    watchdog.on_step_end(None, SimpleNamespace(global_step=4), control)
    assert watchdog._pending == ["save"] and watchdog.limit() == 800
    watchdog._longest["save"] = 20
    assert watchdog.limit() == 300
    watchdog.on_save(None, None, None)
    assert watchdog._pending == [] and watchdog.limit() == 600
    assert HangWatchdogCallback(limit_s=42).limit() == 42


def test_the_thread_stops_when_training_ended_without_on_train_end(tmp_path):
    """train() raised (no on_train_end): the thread sees no training loop and never fires."""
    watchdog = HangWatchdogCallback(limit_s=0.2)
    watchdog.on_train_begin(_args(tmp_path), SimpleNamespace(global_step=0), None)
    watchdog._thread.join(timeout=5)
    assert not watchdog._thread.is_alive() and not (tmp_path / "hang").exists()


def test_innermost_frame_reads_the_scripts_thread_of_a_dump(tmp_path):
    def blocked_here() -> str:
        with open(tmp_path / "dump.txt", "w") as f:  # faulthandler writes to a real file
            faulthandler.dump_traceback(file=f, all_threads=True)
        return (tmp_path / "dump.txt").read_text()

    assert innermost_frame(blocked_here()).startswith("blocked_here at test_watchdog.py:")
    assert innermost_frame("Thread 0x1 (most recent call first):\n  <no Python frame>\n") == "?"
