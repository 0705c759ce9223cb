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


def test_arrivals_count_the_first_call_of_each_micro_step():
    arrivals = Arrivals()
    arrivals.forward_called()  # outside a step (evaluation): not an arrival
    assert arrivals.take() == 0.0
    arrivals.step_began()
    before = time.time()
    arrivals.forward_called()
    arrivals.forward_called()  # a second call in the same micro-step: not counted again
    assert before <= arrivals.take() <= time.time()
    assert arrivals.take() == 0.0


def test_the_report_names_rank_and_host_in_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dist"):
        keys = report({1: 0.3}, ["node-a", "node-b"], step_time=0.6, step=12)
    assert keys == {"perf/straggler_rank_1_late_s": 0.3}
    assert len(caplog.records) == 1
    assert (
        "straggler at step 12: rank 1 on node-b (0.30 s, 50% of a step) arrives after the median rank" in caplog.text
    )
    assert report({}, ["node-a"], 1.0, 1) == {}
