"""hf_dist.recipe_utils: flags the user gave are honoured (--save_steps)."""

from __future__ import annotations

import pytest

from hf_dist import recipe_utils as ru

REAL = {"output_dir": "out/real"}


def parse(argv, types=(ru.ModelArguments,)):
    return ru.parse_recipe_args(types, argv, embedded_defaults=ru.EMBEDDED_TRAINING_DEFAULTS, real_defaults=REAL)


# ---------------------------------------------------------------- flags the user gave are honoured


def test_save_steps_alone_saves_on_the_embedded_default():
    """The embedded default saves only at the end (save_strategy "no"): --save_steps 25 saved nothing."""
    *_, kwargs, _ = parse(["--save_steps", "25"])
    assert (kwargs["save_strategy"], kwargs["save_steps"]) == ("steps", 25)
    *_, kwargs, _ = parse([])
    assert kwargs["save_strategy"] == "no"  # the default itself is unchanged
    *_, kwargs, _ = parse(["--eval_steps", "5"])
    assert kwargs["eval_strategy"] == "steps"


@pytest.mark.parametrize("flags", [["--save_strategy", "no"], ["--save_strategy", "epoch"]])
def test_save_steps_with_a_strategy_that_ignores_it_is_refused(flags):
    with pytest.raises(ValueError, match=rf"--save_steps 2 has no effect with --save_strategy {flags[1]}: pass "):
        parse(["--save_steps", "2", *flags])
    *_, kwargs, _ = parse(["--save_steps", "2", "--save_strategy", "steps"])
    assert kwargs["save_strategy"] == "steps"
