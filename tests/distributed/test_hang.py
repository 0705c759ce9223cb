"""A hung rank on 2 CPU ranks: the watchdog writes every rank's stacks and ends the job in seconds, not after the
process group's timeout, and the run resumes from its last complete checkpoint."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import hf_dist
from hf_dist.callbacks.watchdog import HANG_EXIT_CODE
from hf_dist.testing import REPO_ROOT, cpu_env, torchrun_command

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests/distributed/scripts/lifecycle_train.py"


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    out = tmp_path_factory.mktemp("hang")
    args = ["--output-dir", out, "--max-steps", "6", "--save-steps", "2", "--hang", "3:1", "--watchdog-limit", "4"]
    start = time.monotonic()
    proc = subprocess.run(torchrun_command(SCRIPT, args), env=cpu_env(), capture_output=True, text=True, timeout=300)
    return out, proc, time.monotonic() - start


def test_the_job_ends_within_the_limit_with_the_exit_code(hung):
    out, proc, seconds = hung
    assert proc.returncode != 0 and seconds < 90, (seconds, proc.stderr[-3000:])  # the gloo timeout is 30 min
    assert f"exitcode  : {HANG_EXIT_CODE}" in proc.stderr or f"exit code {HANG_EXIT_CODE}" in proc.stderr, proc.stderr


def test_every_rank_wrote_its_stacks_and_rank_0_says_where_each_is(hung):
    out, proc, _ = hung
    stacks = {r: (out / "hang" / "2" / f"rank{r}.txt").read_text() for r in (0, 1)}
    assert "on_step_begin" in stacks[1] and "time.sleep" not in stacks[0]  # rank 1 blocked in the callback
    assert "no progress for 4 s after step 2" in stacks[0]
    assert "the job hung after step 2: no progress for 4 s on rank 0. Main threads:" in proc.stderr
    assert "  rank 1: on_step_begin at lifecycle_train.py:" in proc.stderr
    rank0 = next(line for line in proc.stderr.splitlines() if line.startswith("  rank 0: "))
    assert "lifecycle_train.py" not in rank0, rank0  # rank 0 waits inside torch (a collective), not in the script


def test_the_run_resumes_from_its_last_complete_checkpoint(hung):
    out, _, _ = hung
    assert hf_dist.auto_resume(out, strategy="ddp") == str(out / "checkpoint-2")
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
