"""Straggler detection (hf_dist.callbacks.stragglers): the ranks that arrive at their steps after the others."""

from __future__ import annotations

import logging
import time

import pytest

from hf_dist.callbacks.stragglers import Arrivals, report, stragglers


def test_a_rank_arriving_late_is_named_with_its_lateness_per_step():
    # 4 steps of 1 s; rank 3 arrived 0.3 s after the others at every step
    sums = [100.0, 100.01, 100.0, 101.2]
    assert stragglers(sums, steps=4, step_time=1.0) == {3: pytest.approx(1.195 / 4)}
    assert stragglers([50.0, 50.6], steps=2, step_time=0.5) == {1: pytest.approx(0.15)}  # two ranks: their mean


def test_noise_and_small_lateness_raise_no_alarm():
    assert stragglers([100.0, 100.1, 100.05, 100.0], steps=4, step_time=1.0) == {}  # 25 ms per step: 2.5 %
    assert stragglers([10.0, 10.06], steps=2, step_time=0.01) == {}  # 30 ms per step: under the 50 ms floor
    assert stragglers([5.0], steps=1, step_time=1.0) == {}


def test_arrivals_count_the_first_call_of_each_micro_step_of_the_steps_not_excused():
    arrivals = Arrivals()
    arrivals.forward_called()  # outside a step (evaluation): not an arrival
    arrivals.step_ended()
    assert arrivals.take() == (0.0, 1)
    arrivals.step_began()
    before = time.time()
    arrivals.forward_called()
    arrivals.forward_called()  # a second call in the same micro-step: not counted again
    arrivals.step_ended()
    total, steps = arrivals.take()
    assert before <= total <= time.time() and steps == 1
    arrivals.step_began()
    arrivals.forward_called()
    arrivals.step_ended(excused=True)  # a save came before this step: left out
    assert arrivals.take() == (0.0, 0)


def test_the_step_after_a_save_or_an_evaluation_is_not_counted(make_trainer, monkeypatch):
    """Rank 0 alone stages an async save or writes an export, and arrives late at the next step for that: the step
    after a phase is left out, the same on every rank (the phases run on all of them). Real Trainer, one rank: the
    counts each log gathers."""
    from hf_dist.callbacks import throughput
    from hf_dist.callbacks.throughput import ThroughputCallback
    from hf_dist.testing import TokenDataset

    gathered: list[list[float]] = []
    monkeypatch.setattr(throughput._dist, "gather_floats", lambda values: gathered.append(values) or [values])
    trainer = make_trainer(
        [ThroughputCallback()], max_steps=6, save_strategy="steps", save_steps=3, eval_strategy="steps",
        eval_steps=4, eval_dataset=TokenDataset(2),
    )  # fmt: skip
    trainer.train()
    # saves after steps 3 and 6, an evaluation after step 4: steps 4 and 5 are not counted
    assert [values[2] for values in gathered] == [1, 1, 1, 0, 0, 1]
    assert all(values[1] > 0 for i, values in enumerate(gathered) if i not in (3, 4))


def test_ranks_that_left_out_different_steps_are_not_compared():
    from hf_dist.callbacks.throughput import _same_count

    assert _same_count([2.0, 2.0, 2.0]) == 2
    assert _same_count([2.0, 1.0]) == 0  # their sums cover different steps


def test_the_report_names_rank_and_host_in_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        keys = report({1: 0.3}, ["node-a", "node-b"], step_time=0.6, step=12)
    assert keys == {"perf/straggler_rank_1_late_s": 0.3}
    assert len(caplog.records) == 1
    assert (
        "straggler at step 12: rank 1 on node-b (0.30 s, 50% of a step) arrives after the median rank" in caplog.text
    )
    assert report({}, ["node-a"], 1.0, 1) == {}
