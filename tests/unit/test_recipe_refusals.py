"""hf_dist.recipe_utils: flags the user gave are honoured (--save_steps); the recipe's default micro-batch that a
layout on CPU ranks cannot run (Ulysses SP at micro-batch > 1) becomes the global batch, made up by accumulation."""

from __future__ import annotations

import pytest

from hf_dist import recipe_utils as ru
from hf_dist.testing import tiny_llama_config

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


# ---------------------------------------------------------------- sequence parallelism on CPU ranks: micro-batch 1


def test_a_recipe_default_micro_batch_becomes_the_global_batch_under_cpu_sp(monkeypatch):
    """--sp_size 2 on 2 CPU ranks planned the recipe's micro-batch 16 and died after 72 s in torch's `view`; a user
    --per_device_train_batch_size 1 ran with global batch 1. The default now keeps global batch 16 by accumulation."""
    import hf_dist
    from hf_dist.recipe_utils.args import _plan_kwargs

    monkeypatch.setenv("WORLD_SIZE", "2")
    sizes = {"tp_size": None, "cp_size": None, "sp_size": 2}
    default = {"per_device_train_batch_size": 16}

    def plan_kwargs(explicit):
        return _plan_kwargs(default, explicit, "full", 64, "zero2", 16, sizes, False, None)

    assert plan_kwargs(set())["global_batch_size"] == 16 and "micro_batch_size" not in plan_kwargs(set())
    assert plan_kwargs({"per_device_train_batch_size"})["micro_batch_size"] == 16  # the user's: pinned
    assert plan_kwargs({"gradient_accumulation_steps"})["micro_batch_size"] == 16  # so is a split with theirs
    kwargs = hf_dist.auto_args(tiny_llama_config(), gpus=2, **{**plan_kwargs(set()), "seq_len": 64})
    split = (kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"])
    assert split == (1, 16)  # x data parallel 1 = global batch 16
