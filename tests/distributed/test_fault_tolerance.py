"""kill -9 a rank (mid-step and mid-save) under ``torchrun --max-restarts``: the job resumes from the
last complete checkpoint and ends with exactly the weights of an uninterrupted run (CPU, gloo)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dist.checkpoint.formats.names import MANIFEST_NAME, RUN_JOURNAL
from hf_dist.checkpoint.lifecycle.auto_resume import auto_resume
from hf_dist.checkpoint.lifecycle.manifest import is_complete
from hf_dist.testing import REPO_ROOT, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests/distributed/scripts/lifecycle_train.py"
# Static rendezvous on a fixed port, as most users launch torchrun.
RESTARTS = ["--max-restarts=2", "--monitor-interval=0.2"]


def run(out: Path, *extra: str, restarts: bool = False) -> list[dict]:
    args = ["--output-dir", str(out), "--max-steps", "8", "--save-steps", "2", *extra]
    torchrun(SCRIPT, args, timeout=300, extra_launcher_args=RESTARTS if restarts else (), outputs=[out])
    return [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("baseline")
    attempts = run(out)
    assert [a["attempt"] for a in attempts] == [0]
    return out


def assert_same_weights(out: Path, baseline: Path) -> None:
    got, want = final_weights(out), final_weights(baseline)
    assert got.keys() == want.keys()
    # CPU + gloo is deterministic and the Trainer restores RNG, data position, optimizer and
    # scheduler: the restarted run must be bit-identical, not merely close.
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs after restart"


def test_kill_mid_step_twice_resumes_and_matches_uninterrupted(tmp_path, baseline):
    out = tmp_path / "run"
    attempts = run(out, "--kill", "3:1", "--kill", "7:0", restarts=True)
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    assert attempts[0]["resume"] is None
    assert attempts[1]["resume"] == str(out / "checkpoint-2")  # killed at step 3
    assert attempts[2]["resume"] == str(out / "checkpoint-6")  # killed at step 7
    assert (out / "killed_step_3").exists() and (out / "killed_step_7").exists()
    assert_same_weights(out, baseline)


def trained_conversations(out: Path) -> dict[tuple[int, int], list[int]]:
    """(step, rank) -> the conversation ids that step trained on, as the last attempt that ran it logged them."""
    steps: dict[tuple[int, int], list[int]] = {}
    for rank in (0, 1):
        for line in (out / f"conversations-rank{rank}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            steps[entry["step"], rank] = entry["ids"]  # a later attempt's step replaces the killed one's
    return steps


def test_packed_run_killed_mid_epoch_resumes_at_the_next_packed_row(tmp_path):
    """Packing is deterministic given the data and the seed: killed at step 3 and restarted from checkpoint-2, the
    run trains steps 3-8 on exactly the conversations the uninterrupted run trained on, none twice, none skipped."""
    base, out = tmp_path / "base", tmp_path / "run"
    run(base, "--packed")
    attempts = run(out, "--packed", "--kill", "3:1", restarts=True)
    assert [a["resume"] for a in attempts] == [None, str(out / "checkpoint-2")]
    want, got = trained_conversations(base), trained_conversations(out)
    assert sorted(want) == [(step, rank) for step in range(1, 9) for rank in (0, 1)]
    assert got == want
    trained = [i for ids in want.values() for i in ids]
    assert len(trained) == len(set(trained)) > 8 * 2 * 2  # one epoch: no conversation twice, several per row
    resumed = [json.loads(line) for line in (out / "conversations-rank0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in resumed if e["attempt"] == 1][0] == 3  # the next packed row after checkpoint-2


def test_kill_during_save_ignores_partial_checkpoint(tmp_path, baseline):
    out = tmp_path / "run"
    attempts = run(out, "--kill-during-save", "4:1", restarts=True)
    assert [a["attempt"] for a in attempts] == [0, 1]
    # Rank 1 died while checkpoint-4 was being written: the folder exists (rank 0 wrote its
    # files) but has no marker, so the restart resumed from checkpoint-2.
    assert "checkpoint-4" in attempts[1]["checkpoints"]
    assert attempts[1]["resume"] == str(out / "checkpoint-2")
    assert_same_weights(out, baseline)
    assert all(is_complete(out / f"checkpoint-{s}") for s in (4, 6, 8))


def test_checkpoint_missing_a_ranks_file_is_never_resumed(tmp_path, baseline):
    out = tmp_path / "copy"
    shutil.copytree(baseline, out, ignore=shutil.ignore_patterns("final"))
    assert auto_resume(out) == str(out / "checkpoint-8")
    (out / "checkpoint-8" / "rng_state_1.pth").unlink()
    assert not is_complete(out / "checkpoint-8")
    assert auto_resume(out) == str(out / "checkpoint-6")
    # Without its manifest, in the folder of a run that wrote manifests (its journal says it started at step 0), a
    # checkpoint after that step is no save that run finished: skipped
    (out / "checkpoint-6" / MANIFEST_NAME).unlink()
    assert auto_resume(out) == str(out / "checkpoint-4")
    # A run without hf_dist's callbacks keeps no journal: then the checkpoint is proven from the files it holds
    (out / RUN_JOURNAL).unlink()
    assert auto_resume(out) == str(out / "checkpoint-6")
    # ... and skipped when they fail the proof: a rank's RNG state missing, as a kill after rank 0's save leaves it.
    # Full weights do not record how many ranks wrote them: the restart's own world size (2) says how many RNG files.
    (out / "checkpoint-6" / "rng_state_1.pth").unlink()
    assert auto_resume(out, world_size=2) == str(out / "checkpoint-4")


def test_uninterrupted_run_marks_every_checkpoint_complete(baseline):
    for step in (4, 6, 8):  # save_total_limit=3 rotated checkpoint-2 away
        marker = json.loads((baseline / f"checkpoint-{step}" / MANIFEST_NAME).read_text())
        assert marker["world_size"] == 2 and marker["step"] == step and marker["strategy"] == "ddp"
        assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "model.safetensors"} <= set(marker["files"])
    assert not (baseline / "checkpoint-2").exists()


def test_async_save_killed_during_its_background_write_resumes_from_the_checkpoint_before(tmp_path, baseline):
    """async_save: rank 1 is killed at step 5 while checkpoint-4 is still being written in the background (each write
    first sleeps 1 s). checkpoint-4 has no marker and its hf_dist_writing.json note, so the restart resumes from
    checkpoint-2 and ends with the uninterrupted synchronous run's weights; its checkpoints hold the same files."""
    out = tmp_path / "run"
    attempts = run(out, "--async-save", "--slow-write", "1", "--kill", "5:1", restarts=True)
    assert [a["attempt"] for a in attempts] == [0, 1]
    assert "checkpoint-4" in attempts[1]["checkpoints"]
    assert attempts[1]["resume"] == str(out / "checkpoint-2")
    assert_same_weights(out, baseline)
    for step in (4, 6, 8):
        got, want = (json.loads((d / f"checkpoint-{step}" / MANIFEST_NAME).read_text()) for d in (out, baseline))
        assert sorted(got["files"]) == sorted(want["files"]) and is_complete(out / f"checkpoint-{step}")
    optimizer, reference = (
        torch.load(d / "checkpoint-8" / "optimizer.pt", weights_only=True) for d in (out, baseline)
    )
    assert all(torch.equal(v, reference["state"][p][k]) for p, s in optimizer["state"].items() for k, v in s.items())
    stalls = json.loads((out / "facts.json").read_text())["save_stalls_s"]
    assert len(stalls) == 3 and max(stalls) < 1.0, stalls  # the attempt after the kill saved 4, 6, 8


def test_one_live_job_per_output_folder_and_orphans_stop(tmp_path):
    """Job A trains (slowly) into a folder; job B into the same folder is refused on every rank, naming A's host and
    rank-0 pid; kill -9 of A's launcher stops A's ranks within seconds instead of leaving them training; job C then
    takes A's stale lock over and resumes A's newest complete checkpoint."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from hf_dist.checkpoint.formats.names import OUTPUT_LOCK
    from hf_dist.testing import cpu_env, torchrun_command

    out = tmp_path / "run"
    slow = ["--output-dir", str(out), "--max-steps", "400", "--save-steps", "2", "--straggler", "1"]
    job_a = subprocess.Popen(torchrun_command(SCRIPT, slow), env=cpu_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (is_complete(out / "checkpoint-2") and (out / OUTPUT_LOCK).exists()):
            assert job_a.poll() is None, "job A ended early"
            time.sleep(0.5)
        holder = json.loads((out / OUTPUT_LOCK).read_text())
        ranks = psutil.Process(job_a.pid).children()
        assert len(ranks) == 2 and holder["pid"] in {r.pid for r in ranks}
        with pytest.raises(RuntimeError, match=rf"is being written by another job: host \S+, pid {holder['pid']}, "):
            run(tmp_path / "run", "--max-steps", "4")
        os.kill(job_a.pid, signal.SIGKILL)  # the launcher only: its ranks are orphaned
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks {[p.pid for p in alive]} kept training after their launcher died"
    finally:
        if job_a.poll() is None:
            os.killpg(job_a.pid, signal.SIGKILL)
    done = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if is_complete(p))
    attempts = run(out, "--max-steps", str(done + 2))
    assert attempts[-1]["resume"] == str(out / f"checkpoint-{done}")
    assert not (out / OUTPUT_LOCK).exists()  # C took A's stale lock over and released it at its end
