"""The hang watchdog's phases on 2 real CPU ranks, in one ``torchrun --max-restarts=1`` launch with scaled-down
allowances (factor 10, at least 5 s, 60 s for the first instance of a phase):

- attempt 0: rank 0 stages its async save of checkpoint-2 alone for 10 s while rank 1 waits for it in step 3's
  collectives, over its step allowance (``average_tokens_across_devices=False``: nothing syncs the ranks before the
  step). Rank 0 makes progress in its save, so this is no hang, and rank 0 is not named a straggler for its late
  arrival at step 3. Then rank 1 blocks at step 5's start: no rank makes progress, every rank writes its stacks and
  the job exits with code 75.
- attempt 1 resumes from checkpoint-2; its first step is 8 s slow on every rank (over a later step's allowance, under
  the first step's) and it trains to the end.

Nothing here times the ranks: the allowances are what the watchdog learned, and the test reads what it decided.
"""

from __future__ import annotations

import json

import pytest

from hf_dist.callbacks.watchdog import HANG_EXIT_CODE
from hf_dist.testing import REPO_ROOT, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests/distributed/scripts/lifecycle_train.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hang")
    args = [
        "--output-dir", out, "--max-steps", "6", "--save-steps", "2", "--async-save", "--no-average-tokens",
        "--watchdog", "10,5,60", "--slow-save", "2:0:10", "--hang", "5:1", "--slow-first-step", "8",
    ]  # fmt: skip
    restarts = ["--max-restarts=1", "--monitor-interval=0.2"]
    proc = torchrun(SCRIPT, args, timeout=400, extra_launcher_args=restarts, outputs=[out])
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    return out, proc.stdout + proc.stderr, attempts


def test_only_the_real_hang_ended_an_attempt_and_the_restart_finished(run):
    out, log, attempts = run
    assert [a["attempt"] for a in attempts] == [0, 1], log[-3000:]
    assert attempts[1]["resume"] == str(out / "checkpoint-2")  # checkpoint-4 was still being written at the hang
    assert sorted(p.name for p in (out / "hang").iterdir()) == ["4"], log[-3000:]  # not the save, not the 1st step
    assert log.count("the job hung after step") == 1
    assert str(HANG_EXIT_CODE) in log  # the launcher reports the attempt's exit code
    assert json.loads((out / "facts.json").read_text())["model_class"] == "LlamaForCausalLM"
    steps = [h["step"] for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]
    assert steps == [1, 2, 3, 4, 5, 6]  # 1-2 from checkpoint-2, then the resumed attempt from its slow first step


def test_every_rank_wrote_its_stacks_and_rank_0_says_where_each_is(run):
    out, log, _ = run
    stacks = {r: (out / "hang" / "4" / f"rank{r}.txt").read_text() for r in (0, 1)}
    for rank, text in stacks.items():
        assert text.startswith(f"rank {rank}: no progress in step for "), text[:200]
    assert "on_step_begin" in stacks[1] and "time.sleep" not in stacks[0]  # rank 1 blocked in the callback
    assert "the job hung after step 4: no rank made progress within its phase's allowance. Ranks:" in log
    rank1 = next(line for line in log.splitlines() if line.startswith("  rank 1: "))
    assert (
        rank1.startswith("  rank 1: step, silent ") and "main thread in on_step_begin at lifecycle_train.py:" in rank1
    )
    rank0 = next(line for line in log.splitlines() if line.startswith("  rank 0: "))
    assert "lifecycle_train.py" not in rank0, rank0  # rank 0 waits inside torch (a collective), not in the script


def test_the_rank_that_staged_the_save_is_not_named_a_straggler(run):
    _, log, _ = run
    assert "straggler at step 3: rank 0" not in log  # it arrived 10 s late at step 3, for its save
