"""One request: `PlanRequest` is what `hf_dist.plan`, `auto_args`, `hf-dist plan` and the recipes' layout flags build."""

from __future__ import annotations

import dataclasses

import pytest

import hf_dist
from hf_dist.cli.main import main
from hf_dist.planning.request import PlanRequest, request_help
from hf_dist.testing import tiny_llama_config


def test_every_field_says_what_it_is_and_every_section_field_is_a_flag_with_that_text(capsys):
    import argparse

    from hf_dist.cli.plan import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)  # hf-dist plan's parser
    flags = {option: action for action in parser._actions for option in action.option_strings}
    for f in dataclasses.fields(PlanRequest):
        assert len(f.metadata["help"]) > 20, f.name
        if f.metadata["section"] is not None:
            action = flags[f.metadata.get("flag") or "--" + f.name.replace("_", "-")]
            assert (action.dest, action.help) == (f.name, f.metadata["help"])
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "layout pins (default: searched):" in capsys.readouterr().out  # listed by section


def test_plan_of_a_request_is_the_plan_of_its_keywords_and_keywords_set_over_it():
    request = PlanRequest(gpus=8, gpu_memory_gib=80, global_batch_size=64, seq_len=64)
    by_request = hf_dist.plan(tiny_llama_config(), request)
    by_keywords = hf_dist.plan(tiny_llama_config(), **request.given())
    assert by_request.to_dict() == by_keywords.to_dict()
    pinned = hf_dist.plan(tiny_llama_config(), request, strategy="zero3")
    assert pinned.strategy == "zero3" and pinned.global_batch_size == 64
    assert request.given() == {"gpus": 8, "gpu_memory_gib": 80, "global_batch_size": 64, "seq_len": 64}


def test_an_unknown_keyword_is_refused_naming_the_fields():
    with pytest.raises(TypeError, match=r"unknown planner keyword\(s\) \['global_batch'\]; a PlanRequest has \["):
        hf_dist.plan(tiny_llama_config(), gpus=8, global_batch=64)


def test_the_search_refuses_a_trace_it_cannot_do():
    from hf_dist.planning.planner import plan

    with pytest.raises(ValueError, match=r"call hf_dist.plan\(..., verify=True\)"):
        plan(tiny_llama_config(), PlanRequest(gpus=1, gpu_memory_gib=80, verify=True))


def test_auto_args_takes_a_request_and_refuses_a_field_given_twice_with_two_values():
    request = PlanRequest(gpus=2, gpu_memory_gib=80, global_batch_size=8, seq_len=64, strategy="zero3")
    kwargs = hf_dist.auto_args(tiny_llama_config(), request, output_dir="out", engine_on_cpu=True)
    assert kwargs["deepspeed"]["zero_optimization"]["stage"] == 3
    same = hf_dist.auto_args(tiny_llama_config(), request, strategy="zero3", output_dir="out", engine_on_cpu=True)
    assert same["deepspeed"]["zero_optimization"] == kwargs["deepspeed"]["zero_optimization"]
    with pytest.raises(ValueError, match=r"strategy: 'zero3' in the request, 'ddp' as a keyword"):
        hf_dist.auto_args(tiny_llama_config(), request, strategy="ddp", output_dir="out")
    with pytest.raises(TypeError, match="must be a hf_dist.PlanRequest, got dict"):
        hf_dist.auto_args(tiny_llama_config(), {"gpus": 2}, output_dir="out")


def test_the_recipes_layout_flags_show_the_requests_help_and_build_a_request():
    from hf_dist import recipe_utils as ru
    from hf_dist.recipe_utils.flags import LAYOUT_PINS

    for name in LAYOUT_PINS:
        field = next(f for f in dataclasses.fields(ru.ModelArguments) if f.name == name)
        assert field.metadata["help"] == request_help(name)
    assert "(one of: none, optimizer, optimizer+params)" in request_help("offload")
    args = ru.ModelArguments(strategy="zero2", sp_size=2, offload="optimizer")
    request = args.plan_request("lora", 128, peft_config="cfg", async_save=True)
    assert request.given() == {"strategy": "zero2", "sp_size": 2, "offload": "optimizer", "method": "lora",
                               "seq_len": 128, "peft_config": "cfg", "async_save": True}  # fmt: skip
    assert args.plan_request("full", 128, peft_config="cfg").peft_config is None  # full fine-tuning plans no LoRA
