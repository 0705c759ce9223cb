"""hf_dist.recipe_utils: every refusal of a recipe's arguments comes before any model is built and is said once,
without a traceback (refusal.py, checks.py); flags the user gave are honoured (--save_steps); the batch a layout on
CPU ranks cannot run (Ulysses SP at micro-batch > 1) is made up by accumulation or refused with the arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_dist import recipe_utils as ru
from hf_dist.planning.features import LibraryFeatures, installed_features
from hf_dist.testing import REPO_ROOT, tiny_llama_config

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


def test_a_command_line_argparse_refuses_raises_instead_of_printing_usage_on_every_rank(capsys):
    with pytest.raises(ValueError, match=r"unrecognized arguments: --no_such_flag 1 \(see --help for every flag\)"):
        parse(["--no_such_flag", "1"])
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- the entry point: once, short, exit 2 everywhere


def refusing_main():
    with ru.checking():
        raise ValueError("--output_dir x is a file, not a folder: pass a folder\n  second line")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refusal_is_printed_once_by_rank_0_and_every_rank_exits_2(rank, monkeypatch, capsys):
    """Rank 0 says it at once; another rank first gives rank 0 the grace period (its launcher stops it once rank 0
    exited: a rank that exited first got rank 0 stopped before it spoke), and says it only if it is still running."""
    from hf_dist.recipe_utils import refusal

    waited = []
    monkeypatch.setattr(refusal.time, "sleep", waited.append)
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exited:
        ru.run_recipe(refusing_main)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    expected = "[hf_dist] refused: --output_dir x is a file, not a folder: pass a folder\n  second line\n"
    assert (out, err) == ("", expected)
    assert waited == ([] if rank == "0" else [refusal.RANK_0_GRACE_S])


def test_an_error_outside_the_checks_keeps_its_traceback(monkeypatch):
    def failing_main():
        raise ValueError("a failure while training, not a refusal")

    with pytest.raises(ValueError, match="not a refusal"):
        ru.run_recipe(failing_main)
    with pytest.raises(ru.RecipeRefusal), ru.checking():
        raise OSError("a path")
    with pytest.raises(TypeError), ru.checking():  # a bug in a check is no refusal of the user's input
        raise TypeError("bug")
    import torch.distributed as dist

    with pytest.raises(dist.DistBackendError), ru.checking():  # nor a rank lost during a collective
        raise dist.DistBackendError("connection reset by peer")


# ---------------------------------------------------------------- each refusal, before any model is built


@pytest.fixture
def no_model(monkeypatch):
    """Records every model build and Trainer; the recipes' refusals must leave both empty."""
    built = []
    monkeypatch.setattr(ru, "build_model", lambda *a, **k: built.append("model"))
    monkeypatch.setattr(ru, "make_trainer", lambda *a, **k: built.append("trainer"))
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    return built


def unreachable_hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once


def an_earlier_run(out):
    (out / "checkpoint-2").mkdir(parents=True)


def fsdp_on_cpu_off(monkeypatch):
    import hf_dist.runtime.cpu_fsdp as cpu_fsdp

    monkeypatch.setattr(cpu_fsdp, "fsdp_on_cpu_enabled", lambda: False)


REFUSALS = {
    # name: (flags, set-up(out, monkeypatch), the refusal's first words)
    "output dir is a file": ([], lambda out, mp: out.write_text("x"), "--output_dir {out} is a file"),
    "output dir below a file": (["--output_dir", "{out}/sub"], lambda out, mp: out.write_text("x"),
                                "--output_dir {out}/sub lies below {out}, which is a file: pass a folder"),
    "earlier checkpoints": ([], lambda out, mp: an_earlier_run(out), "--output_dir {out} already holds checkpoints"),
    "hub unreachable": (["--model_name_or_path", "meta-llama/Llama-3.2-1B"], lambda out, mp: unreachable_hub(mp),
                        "could not resolve model 'meta-llama/Llama-3.2-1B': it is not a local folder or file, and "
                        "the hub (http://127.0.0.1:9) cannot be reached"),
    "fsdp on cpu": (["--strategy", "fsdp_full_shard"], lambda out, mp: fsdp_on_cpu_off(mp),
                    "FSDP on CPU ranks (the plan's, or your --fsdp / accelerate FSDP config): accelerate would"),
    "save_steps ignored": (["--save_steps", "2", "--save_strategy", "no"], lambda out, mp: None,
                           "--save_steps 2 has no effect with --save_strategy no"),
    "unknown flag": (["--sav_steps", "2"], lambda out, mp: None, "unrecognized arguments: --sav_steps 2"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSALS))
@pytest.mark.parametrize("recipe", ["sft", "pretrain"])
def test_each_refusal_comes_before_any_model_is_built(recipe, name, tmp_path, monkeypatch, no_model):
    flags, set_up, first = REFUSALS[name]
    out = tmp_path / "out"
    set_up(out, monkeypatch)
    argv = ["--output_dir", str(out), *[f.format(out=out) for f in flags]]
    main = ru.load_recipe(REPO_ROOT / "recipes" / f"{recipe}.py").main
    with pytest.raises(ru.RecipeRefusal) as refused:
        main(argv)
    assert str(refused.value).startswith(first.format(out=out)), refused.value
    assert no_model == []


def test_the_hub_check_is_one_connection_attempt_of_at_most_1_5_s_not_a_minute_of_retries(monkeypatch):
    """huggingface_hub retried each file from every rank (79 s on 2 ranks): the check makes one bounded attempt."""
    import socket

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    attempts = []

    def refuse(address, timeout=None, *args, **kwargs):
        attempts.append((address, timeout))
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refuse)
    with pytest.raises(ValueError, match=r"could not resolve model 'org/model'.*cannot be reached.*HF_HUB_OFFLINE=1"):
        ru.check_model_source(ru.ModelArguments(model_name_or_path="org/model"))
    assert len(attempts) == 1 and attempts[0][1] <= 1.5, attempts
    ru.check_model_source(ru.ModelArguments(model_name_or_path=str(REPO_ROOT)))  # a local folder: never asked
    assert len(attempts) == 1


def test_engines_cpu_ranks_would_not_run_as_asked_are_refused(monkeypatch):
    import hf_dist.runtime.cpu_fsdp as cpu_fsdp

    monkeypatch.setattr(cpu_fsdp, "fsdp_on_cpu_enabled", lambda: False)
    monkeypatch.setattr(cpu_fsdp, "parallelism_config_on_cpu_allowed", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    plain = dict(fsdp=[], deepspeed=None, use_cpu=False, parallelism_config=None)
    ru.check_engine_runs_here(SimpleNamespace(**plain), has_accelerator=False)
    cases = {
        "fsdp": ({"fsdp": ["full_shard"]}, "Pass --fsdp_on_cpu"),
        "deepspeed": ({"deepspeed": {"zero_optimization": {}}}, "Launch with ACCELERATE_USE_CPU=false"),
        "tp": ({"parallelism_config": SimpleNamespace(tp_size=2, cp_size=1, sp_size=1)},
               r"--tp_size 2 on CPU ranks: accelerate refuses a ParallelismConfig.*--model_parallel_on_cpu"),
    }  # fmt: skip
    for given, message in cases.values():
        args = SimpleNamespace(**{**plain, **given})
        with pytest.raises(ValueError, match=message):
            ru.check_engine_runs_here(args, has_accelerator=False)
        ru.check_engine_runs_here(args, has_accelerator=True)  # GPUs run them
    monkeypatch.setattr(cpu_fsdp, "parallelism_config_on_cpu_allowed", lambda: True)  # --model_parallel_on_cpu
    ru.check_engine_runs_here(SimpleNamespace(**{**plain, **cases["tp"][0]}), has_accelerator=False)


# ---------------------------------------------------------------- sequence parallelism on CPU ranks: micro-batch 1


def test_a_recipe_default_micro_batch_becomes_the_global_batch_under_cpu_sp(monkeypatch):
    """--sp_size 2 on 2 CPU ranks planned the recipe's micro-batch 16 and died after 72 s in torch's `view`; a user
    --per_device_train_batch_size 1 ran with global batch 1. The default now keeps global batch 16 by accumulation."""
    import hf_dist
    from hf_dist.planning.request import PlanRequest
    from hf_dist.recipe_utils.args import with_batch

    monkeypatch.setenv("WORLD_SIZE", "2")
    default = {"per_device_train_batch_size": 16}

    def plan_kwargs(explicit):
        request = PlanRequest(method="full", seq_len=64, strategy="zero2", sp_size=2)
        return with_batch(request, default, explicit).given()

    assert plan_kwargs(set())["global_batch_size"] == 16 and "micro_batch_size" not in plan_kwargs(set())
    assert plan_kwargs({"per_device_train_batch_size"})["micro_batch_size"] == 16  # the user's: pinned
    assert plan_kwargs({"gradient_accumulation_steps"})["micro_batch_size"] == 16  # so is a split with theirs
    recipe = plan_kwargs(set())
    p = hf_dist.plan(tiny_llama_config(), gpus=2, features=LibraryFeatures(), **recipe)
    assert (p.micro_batch_size, p.gradient_accumulation_steps) == (1, 16)  # x data parallel 1 = global batch 16
    if not installed_features().sequence_parallel:  # the lowest set has no Ulysses: the recipe refuses, saying why
        with pytest.raises(ValueError, match="sp_size 2 cannot run here: needs accelerate >= 1.12"):
            hf_dist.auto_args(tiny_llama_config(), gpus=2, engine_on_cpu=True, **recipe)
        return
    kwargs = hf_dist.auto_args(tiny_llama_config(), gpus=2, engine_on_cpu=True, **recipe)
    assert (kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"]) == (1, 16)
