"""HangWatchdogCallback: an allowance per phase, learned from that phase's own durations; a run hung only when no rank
makes progress; the stacks of a hang (the hang of a real 2-rank job: tests/distributed/test_hang.py).

The phases run in a real Trainer on a tiny model, with an injected clock: a test advances it inside a phase (an
evaluation batch, a save, an export, the first step) and asks the watchdog at that moment what its thread would
decide. No test depends on how fast this machine is.
"""

from __future__ import annotations

import faulthandler
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from hf_dist.callbacks import ExportCallback, attach, watchdog
from hf_dist.callbacks.phases import CLOCK, Phase, PhaseClock
from hf_dist.callbacks.progress_board import ProgressBoard
from hf_dist.callbacks.resume import AsyncCheckpointCallback, CompleteCheckpointCallback
from hf_dist.callbacks.watchdog import HangWatchdogCallback, innermost_frame, rank_line, watching
from hf_dist.testing import TokenDataset

SCALED = dict(factor=10, min_limit_s=30, first_limit_s=100)  # 300 s and 1800 s in production


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    """This process's phase clock, reading a clock that moves only when the test says."""
    fake = FakeClock()
    monkeypatch.setattr(CLOCK, "clock", fake)
    CLOCK.reset()
    yield fake
    CLOCK.reset()


@pytest.fixture
def exits(monkeypatch):
    """No watchdog thread (the test asks the watchdog itself), and the exit codes a hang would end the job with."""
    codes: list[int] = []
    monkeypatch.setattr(HangWatchdogCallback, "_start_thread", lambda self: None)
    monkeypatch.setattr(watchdog, "_exit_job", codes.append)
    return codes


def slow(clock, watch: HangWatchdogCallback, silences, verdicts: list, then=None):
    """A function that, each time it is called inside a phase, lets ``next(silences)`` seconds pass without progress,
    records whether the watchdog ended the run (its thread's check at that moment), then returns ``then(...)``."""

    def work_without_progress(*args, **kwargs):
        clock.advance(next(silences))
        verdicts.append(watch._poll())
        return then(*args, **kwargs) if then is not None else None

    return work_without_progress


def first_forward_only(work):
    done: list[bool] = []

    def hook(module, args):
        if not done:
            done.append(True)
            work()

    return hook


def stacks(out, step: int) -> str:
    return (out / "hang" / str(step) / "rank0.txt").read_text()


def test_a_long_second_evaluation_is_not_a_hang_and_a_hung_one_is_caught(make_trainer, clock, exits, tmp_path):
    watch = HangWatchdogCallback(**SCALED)
    trainer = make_trainer(
        [watch], max_steps=6, eval_strategy="steps", eval_steps=2, eval_dataset=TokenDataset(2),
        per_device_eval_batch_size=2,
    )  # fmt: skip
    verdicts: list[bool] = []
    # one batch per evaluation; its silence: 8 s, then 70 s (over min_limit_s, under 10 x 8 s), then 701 s
    eval_batch = slow(clock, watch, iter([8.0, 70.0, 701.0]), verdicts)
    trainer.model.register_forward_pre_hook(lambda module, args: None if module.training else eval_batch())
    trainer.train()
    assert verdicts == [False, False, True]
    assert exits == [watchdog.HANG_EXIT_CODE]
    dump = stacks(tmp_path / "out", 6)
    assert dump.startswith("rank 0: no progress in evaluation for 701.0 s (allowance 700.0 s) after step 6\n")
    assert "work_without_progress" in dump and "evaluation_loop" in dump  # where the rank was, every thread


def test_a_slow_first_step_after_a_resume_is_not_a_hang_and_a_hung_one_is_caught(make_trainer, clock, exits, tmp_path):
    make_trainer(max_steps=2, save_strategy="steps", save_steps=2).train()
    for silence, hung in ((500.0, False), (1001.0, True)):
        CLOCK.reset()  # a restarted job learned nothing yet
        watch = HangWatchdogCallback(**{**SCALED, "first_limit_s": 1000})
        trainer = make_trainer([watch], max_steps=4)
        verdicts: list[bool] = []
        warm_up = slow(clock, watch, iter([silence]), verdicts)
        trainer.model.register_forward_pre_hook(first_forward_only(warm_up))
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        assert verdicts == [hung], silence  # 500 s: over min_limit_s (the old limit there), under first_limit_s
    assert exits == [watchdog.HANG_EXIT_CODE]
    assert stacks(tmp_path / "out", 2).startswith("rank 0: no progress in first step for 1001.0 s (allowance 1000.0")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_slow_save_is_not_a_hang_and_a_hung_one_is_caught(make_trainer, clock, exits, tmp_path, async_save):
    watch = HangWatchdogCallback(**SCALED)
    trainer = make_trainer(max_steps=6, save_strategy="steps", save_steps=2)
    saving = AsyncCheckpointCallback() if async_save else CompleteCheckpointCallback()
    attach(trainer, [saving, watch])
    verdicts: list[bool] = []
    # inside each save (the async one: its staging), 8 s, then 60 s (under 10 x 8 s), then 601 s without progress
    trainer._save_rng_state = slow(clock, watch, iter([8.0, 60.0, 601.0]), verdicts, then=trainer._save_rng_state)
    trainer.train()
    assert verdicts == [False, False, True]
    assert exits == [watchdog.HANG_EXIT_CODE]
    dump = stacks(tmp_path / "out", 6)
    assert dump.startswith("rank 0: no progress in save for 601.0 s (allowance 600.0 s) after step 6\n")
    assert "_save_checkpoint" in dump


def test_a_slow_export_is_not_a_hang_and_a_hung_one_is_caught(make_trainer, clock, exits, tmp_path):
    for silence, hung in ((8.0, False), (60.0, False), (601.0, True)):  # one process, three runs: it learns
        watch = HangWatchdogCallback(**SCALED)
        trainer = make_trainer([watch, ExportCallback()], max_steps=1)  # the export after the watchdog's train end
        verdicts: list[bool] = []
        trainer.model.save_pretrained = slow(
            clock, watch, iter([silence]), verdicts, then=trainer.model.save_pretrained
        )
        trainer.train()
        assert verdicts == [hung], silence
    assert stacks(tmp_path / "out", 1).startswith("rank 0: no progress in export for 601.0 s (allowance 600.0 s)")


def test_the_recipes_export_after_training_is_watched_as_an_export(make_trainer, clock, exits, tmp_path):
    from hf_dist.recipe_utils.export import export_model

    watch = HangWatchdogCallback(**SCALED)
    trainer = make_trainer([watch], max_steps=1)
    trainer.train()
    verdicts: list[bool] = []
    trainer.save_model = slow(clock, watch, iter([101.0]), verdicts, then=trainer.save_model)
    with watching(trainer):
        clock.advance(5000)  # after train(), outside any phase: nothing is timed
        assert watch._poll() is False
        export_model(trainer, None, tmp_path / "final", adapter=False)
    assert verdicts == [True] and exits == [watchdog.HANG_EXIT_CODE]
    assert stacks(tmp_path / "out", 1).startswith("rank 0: no progress in export for 101.0 s (allowance 100.0 s)")


def test_loading_the_best_checkpoint_at_the_end_is_its_own_phase(make_trainer, clock, exits, monkeypatch):
    from transformers import Trainer

    watch = HangWatchdogCallback(**SCALED)
    trainer = make_trainer(
        [watch], max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
        eval_dataset=TokenDataset(2), load_best_model_at_end=True,
    )  # fmt: skip
    verdicts: list[bool] = []
    # 90 s: over a step's 30 s, under a first checkpoint load's 100 s; slowed in the Trainer's own method, which the
    # extension's phase runs around
    monkeypatch.setattr(
        Trainer, "_load_best_model", slow(clock, watch, iter([90.0]), verdicts, then=Trainer._load_best_model)
    )
    trainer.train()
    assert verdicts == [False] and exits == []
    assert CLOCK.longest[Phase.LOAD] == 90.0


def _ranks(tmp_path, fake: FakeClock, *, stale_s: float = 1e9) -> list[HangWatchdogCallback]:
    """Two ranks' watchdogs over one store, each past two steps of 1 s (a step's allowance: 10 s)."""
    store, ranks = dist.HashStore(), []
    for _ in range(2):
        watch = HangWatchdogCallback(factor=10, min_limit_s=5, first_limit_s=100)
        watch.clock, watch.board = PhaseClock(fake), ProgressBoard(store, stale_s=stale_s)
        watch._arm(SimpleNamespace(output_dir=str(tmp_path), ddp_timeout=1800), step=2)
        watch.clock.start_training()
        for _ in range(2):
            fake.advance(1.0)
            watch.clock.step_ended()
        ranks.append(watch)
    return ranks


def _check_every_second(ranks, fake: FakeClock, seconds: int, checking=(0, 1)) -> list[list]:
    out = []
    for _ in range(seconds):
        fake.advance(1.0)
        out.append([ranks[r].hung_step() for r in checking])
    return out


def test_the_run_is_hung_only_when_no_rank_makes_progress_in_its_phase(tmp_path):
    fake = FakeClock()
    ranks = _ranks(tmp_path, fake)
    ranks[0].clock.enter(Phase.SAVE)  # rank 0 stages a save alone (its first: 100 s) ...
    # ... while rank 1 waits for it in the next step's collective: over its 10 s after 10 s, but rank 0 progresses
    assert _check_every_second(ranks, fake, 99) == [[None, None]] * 99
    assert ranks[1].board.anyone_ok(fake()) and not ranks[1].hung_step()
    # rank 0 is past its save's allowance too: no rank makes progress, and both ranks see the same step
    verdicts = _check_every_second(ranks, fake, 2)
    assert verdicts[-1] == [2, 2]


def test_a_rank_that_counts_itself_but_stopped_checking_does_not_keep_a_hung_run_alive(tmp_path):
    fake = FakeClock()
    ranks = _ranks(tmp_path, fake, stale_s=30)
    ranks[0].clock.enter(Phase.SAVE)
    assert _check_every_second(ranks, fake, 20) == [[None, None]] * 20  # both check; rank 0 counts itself
    # rank 0's thread no longer runs (a process stuck holding the GIL): its "ok" is believed for 30 s, not 100
    verdicts = _check_every_second(ranks, fake, 40, checking=(1,))
    assert verdicts[28] == [None] and verdicts[31] == [2]


def test_allowances_per_phase_learned_capped_and_fixed():
    watch = HangWatchdogCallback(**SCALED)
    watch.clock = PhaseClock(FakeClock())
    watch._timeout_s = 1000
    assert watch.allowance(Phase.SAVE) == 100  # no save finished yet: first_limit_s
    watch.clock.longest[Phase.SAVE] = 2.0
    assert watch.allowance(Phase.SAVE) == 30  # 10 x 2 s, at least min_limit_s
    watch.clock.longest[Phase.SAVE] = 60.0
    assert watch.allowance(Phase.SAVE) == 600
    watch.clock.longest[Phase.SAVE] = 500.0
    assert watch.allowance(Phase.SAVE) == 800  # under the process group's timeout
    assert watch.allowance(Phase.EVALUATE) == 100  # each phase its own
    assert watch.allowance(None) == float("inf")  # outside any phase: not timed
    assert HangWatchdogCallback(limit_s=42).allowance(Phase.EXPORT) == 42


def test_a_limit_at_or_above_the_process_group_timeout_is_refused(tmp_path):
    watch = HangWatchdogCallback(limit_s=1800)
    args = SimpleNamespace(output_dir=str(tmp_path), ddp_timeout=1800)
    with pytest.raises(ValueError, match=r"(?s)limit_s=1800\) is not under the process group's timeout.*ddp_timeout"):
        watch.on_train_begin(args, SimpleNamespace(global_step=0), None)
    for bad in ({"limit_s": 0}, {"factor": -1}, {"first_limit_s": 0}):
        with pytest.raises(ValueError, match=r"HangWatchdogCallback\((\w+)=-?\d+\): \1 must be a number > 0; pass"):
            HangWatchdogCallback(**bad)


def test_the_thread_stops_when_training_ended_without_on_train_end(tmp_path):
    """train() raised (no on_train_end): the thread sees no training loop and never fires."""
    watch = HangWatchdogCallback(limit_s=0.2)
    watch.on_train_begin(SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=0), None)
    watch._thread.join(timeout=5)
    assert not watch._thread.is_alive() and not (tmp_path / "hang").exists()


def test_innermost_frame_and_rank_line_read_a_stack_file(tmp_path):
    def blocked_here() -> str:
        with open(tmp_path / "dump.txt", "w") as f:  # faulthandler writes to a real file
            f.write(watchdog.stack_header(1, Phase.SAVE, 12.3, 10.0, 4) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return (tmp_path / "dump.txt").read_text()

    text = blocked_here()
    assert innermost_frame(text).startswith("blocked_here at test_watchdog.py:")
    assert rank_line(text).startswith("save, silent 12.3 s (allowance 10.0 s); main thread in blocked_here at ")
    assert innermost_frame("Thread 0x1 (most recent call first):\n  <no Python frame>\n") == "?"


def test_the_thread_of_an_earlier_trainers_watchdog_stops_when_another_trains(tmp_path):
    """One process, two Trainers trained one after the other: the first one's thread does not judge the second."""
    args = SimpleNamespace(output_dir=str(tmp_path))
    first, second = HangWatchdogCallback(), HangWatchdogCallback()
    first._arm(args, 0)
    assert first._active() is False  # not inside a training loop
    first._window = True
    assert first._active() is True
    second._arm(args, 0)
    assert first._active() is False and second._active() is False
