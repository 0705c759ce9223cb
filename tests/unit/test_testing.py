"""hf_dist.testing: a failed launch says why a rank died in the first lines of the error; a lock a killed build left
is removed before the next build waits on it."""

from __future__ import annotations

import sys

import pytest

from hf_dist.testing import cpu_env, run_checked


def test_aborting_process_reports_the_signal_and_python_stack():
    # what a rank dying in C++ looks like: libstdc++ prints the exception, then abort()
    code = (
        "import os, sys\n"
        "def finalize():\n"
        "    sys.stderr.write(\"terminate called after throwing an instance of 'gloo::IoException'\\n\")\n"
        "    sys.stderr.write('  what():  Connection closed by peer\\n' + 'noise\\n' * 3000)\n"
        "    sys.stderr.flush()\n"
        "    os.abort()\n"
        "finalize()\n"
    )
    with pytest.raises(RuntimeError) as err:
        run_checked([sys.executable, "-c", code], env=cpu_env(), timeout=60)
    message = str(err.value)
    assert message.startswith("command failed with exit code -6")
    head = message.split("--- lines naming the cause ---")[1].split("--- stdout (tail) ---")[0]
    assert "terminate called after throwing an instance of 'gloo::IoException'" in head
    assert "what():  Connection closed by peer" in head
    # PYTHONFAULTHANDLER=1 (set by cpu_env) dumps the Python stack on SIGABRT
    assert "Fatal Python error: Aborted" in head
    assert "line 6 in finalize" in message
    assert "noise" not in head


def test_timeout_kills_the_process_group_and_reports_output():
    code = "import time; print('started', flush=True); time.sleep(60)"
    with pytest.raises(RuntimeError, match=r"timed out after 1s") as err:
        run_checked([sys.executable, "-c", code], env=cpu_env(), timeout=1)
    assert "started" in str(err.value)


def test_fp16_probe_is_the_question_deepspeed_asks(monkeypatch):
    """DeepSpeed refuses fp16 on CPU exactly when the probe says no; the portable-kernel switch is tests-only."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator

    from hf_dist.testing import allow_portable_fp16_in_deepspeed, cpu_has_onednn_fp16

    accelerator = get_accelerator()
    assert accelerator.device_name() == "cpu"
    assert bool(accelerator.is_fp16_supported()) is cpu_has_onednn_fp16()
    monkeypatch.setattr(type(accelerator), "is_fp16_supported", type(accelerator).is_fp16_supported)
    assert allow_portable_fp16_in_deepspeed() is (not cpu_has_onednn_fp16())
    assert accelerator.is_fp16_supported() and torch_float16_in(accelerator.supported_dtypes())


def torch_float16_in(dtypes) -> bool:
    import torch

    return torch.float16 in dtypes


def test_a_gloo_abort_is_launched_once_more_and_nothing_else_is():
    from hf_dist.testing import GLOO_ABORT, retry_gloo_abort

    attempts = []

    def aborts_once(attempt):
        attempts.append(attempt)
        if attempt == 0:
            raise RuntimeError(f"command failed with exit code 1: ...\n{GLOO_ABORT}\nFatal Python error: Aborted")
        return "report"

    with pytest.warns(RuntimeWarning, match="gloo's rare abort"):
        assert retry_gloo_abort(aborts_once) == "report"
    assert attempts == [0, 1]

    def always_aborts(attempt):
        raise RuntimeError(GLOO_ABORT)

    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="terminate called"):
        retry_gloo_abort(always_aborts)
    calls = []

    def other_failure(attempt):
        calls.append(attempt)
        raise RuntimeError("ValueError: a real failure")

    with pytest.raises(RuntimeError, match="a real failure"):
        retry_gloo_abort(other_failure)
    assert calls == [0]  # a real failure is never retried


def test_torchrun_launches_a_gloo_abort_again_without_the_first_attempts_files(tmp_path):
    from hf_dist.testing import GLOO_ABORT, torchrun

    out, kept, log = tmp_path / "out", tmp_path / "out" / "kept.txt", tmp_path / "attempts.txt"
    out.mkdir()
    kept.write_text("from before")
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        f"log, out = {str(log)!r}, {str(out)!r}\n"
        "attempt = len(open(log).read()) if os.path.exists(log) else 0\n"
        "open(log, 'a').write('x')\n"
        "print(sorted(os.listdir(out)))\n"
        "os.makedirs(os.path.join(out, 'checkpoint-2'))\n"
        "open(os.path.join(out, 'partial.json'), 'w').write('{}')\n"
        f"if attempt == 0:\n    sys.stderr.write({GLOO_ABORT!r} + '\\n'); sys.exit(1)\n"
    )
    with pytest.warns(RuntimeWarning, match="gloo's rare abort"):
        proc = torchrun(script, nproc=1, timeout=120, outputs=[out])
    assert log.read_text() == "xx"
    assert "['kept.txt']" in proc.stdout  # the retry started from what was there before, not the first attempt's
    assert kept.read_text() == "from before"


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, capsys):
    """torch's FileBaton waits forever on the lock of a killed JIT build (a `make test` stuck 25 min here on one left
    at 10:22 by an interrupted build); `make aio-op` and `make test-min` remove such locks before loading the ops."""
    import os
    import time

    from hf_dist.testing import STALE_BUILD_LOCK_S, clear_stale_build_locks

    stale, live = tmp_path / "py311_cpu" / "async_io" / "lock", tmp_path / "py311_cpu" / "pin_memory" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    assert clear_stale_build_locks(tmp_path) == [stale]
    assert not stale.exists() and live.exists()  # a build running now keeps its lock
    assert f"removed {stale}: a build lock 31 min old, left by a killed build" in capsys.readouterr().err
    assert clear_stale_build_locks(tmp_path / "nothing-built-yet") == []
