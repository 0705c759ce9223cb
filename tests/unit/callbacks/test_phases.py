"""The phase clock (hf_dist.callbacks.phases): whose silence a silence is, and what a phase learns when it ends."""

from __future__ import annotations

import pytest

from hf_dist.callbacks.extension import TrainerExtension, extend
from hf_dist.callbacks.phases import CLOCK, Phase, PhaseClock, phase


class Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_silence_belongs_to_the_phase_under_way_and_counts_when_its_instance_ends():
    ticks = Ticks()
    clock = PhaseClock(ticks)
    clock.start_training()
    assert clock.current is Phase.FIRST_STEP
    ticks.now += 40  # warm-up
    clock.step_ended()
    assert clock.longest == {Phase.FIRST_STEP: 40} and clock.current is Phase.STEP
    ticks.now += 1
    clock.beat()
    with phase(Phase.SAVE, clock):
        ticks.now += 9
        clock.beat()
        with phase(Phase.EXPORT, clock):  # an export on save: its own phase inside the save
            ticks.now += 30
            assert clock.current is Phase.EXPORT and clock.silence() == 30
            assert Phase.EXPORT not in clock.longest  # an instance under way teaches nothing yet
        ticks.now += 2
    ticks.now += 12  # waiting in the next step for a rank still saving
    clock.step_ended()
    assert clock.longest == {Phase.FIRST_STEP: 40, Phase.SAVE: 9, Phase.EXPORT: 30}  # after a save: no step's pace
    assert clock.entered == 2
    ticks.now += 3
    clock.step_ended()
    assert clock.longest[Phase.STEP] == 3
    clock.stop_training()
    assert clock.current is None


def test_a_phase_that_fails_teaches_nothing():
    ticks = Ticks()
    clock = PhaseClock(ticks)
    with pytest.raises(OSError), phase(Phase.SAVE, clock):
        ticks.now += 7
        raise OSError("disk full")
    assert clock.longest == {} and clock.current is None


def test_a_trainer_is_extended_once_and_its_evaluations_are_phases(make_trainer):
    trainer = make_trainer()
    cls = type(trainer)
    extend(trainer)
    extended = type(trainer)
    extend(trainer)
    assert extend(None) is None
    assert (
        type(trainer) is extended
        and extended.__name__ == cls.__name__
        and extended.__mro__[1:3]
        == (
            TrainerExtension,
            cls,
        )
    )
    assert "evaluate" not in vars(trainer) and not trainer._hf_dist_guards  # a class, not instance patches; no guards
    entered = CLOCK.entered
    trainer.evaluate(eval_dataset=trainer.train_dataset)
    assert CLOCK.entered == entered + 1 and CLOCK.longest.get(Phase.EVALUATE) is not None
    other = make_trainer()
    extend(other, guards=True)
    assert type(other) is extended and other._hf_dist_guards  # one class per Trainer class
