"""hf_dist.recipe_utils: argument handling, input validation before training, QLoRA config, CPU error."""

import json

import pytest
import torch

from hf_dist import PlanRequest
from hf_dist import recipe_utils as ru
from hf_dist.data import DEFAULT_CHAT_TEMPLATE, build_tokenizer
from hf_dist.testing import REPO_ROOT, tiny_llama_config

EMBEDDED = {"output_dir": "out/embedded", "learning_rate": 3e-3, "max_steps": 7}
REAL = {"output_dir": "out/real", "learning_rate": 2e-5}


def parse(argv, types=(ru.ModelArguments, ru.DataArguments)):
    return ru.parse_recipe_args(types, argv, embedded_defaults=EMBEDDED, real_defaults=REAL)


def test_recipe_defaults_apply_only_where_no_flag_was_given():
    model_args, data_args, kwargs, explicit = parse(["--learning_rate", "1e-4", "--max_seq_length", "32"])
    assert model_args.embedded and data_args.max_seq_length == 32
    assert kwargs["learning_rate"] == 1e-4 and kwargs["max_steps"] == 7 and kwargs["output_dir"] == "out/embedded"
    assert explicit == {"learning_rate", "max_seq_length"}


def test_real_model_gets_real_defaults_and_every_training_flag_works():
    _, _, kwargs, explicit = parse(["--model_name_or_path", "some/model", "--gradient_accumulation_steps", "4"])
    assert kwargs["learning_rate"] == 2e-5 and kwargs["output_dir"] == "out/real"
    assert kwargs["gradient_accumulation_steps"] == 4 and "gradient_accumulation_steps" in explicit


def test_lora_target_modules_parse_as_a_list():
    *_, lora_args, _, _ = parse(["--lora_target_modules", "q_proj", "v_proj"], (ru.LoraArguments,))
    assert lora_args.lora_target_modules == ["q_proj", "v_proj"]
    assert ru.LoraArguments().lora_target_modules == list(ru.LLAMA_LORA_TARGETS)


def test_invalid_arguments_are_rejected_with_the_allowed_values():
    with pytest.raises(ValueError, match="not one of"):
        ru.ModelArguments(strategy="zero4")
    with pytest.raises(ValueError, match="lora_r"):
        ru.LoraArguments(lora_r=0)
    with pytest.raises(ValueError, match="nf4, fp4"):
        ru.QuantArguments(bnb_4bit_quant_type="int3")


def test_sequence_length_beyond_positions_is_rejected():
    config = tiny_llama_config(max_position_embeddings=128)
    assert ru.resolve_seq_len(None, config, embedded=True) == 64
    assert ru.resolve_seq_len(None, config, embedded=False) == 128
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings=128"):
        ru.resolve_seq_len(4096, config, embedded=False)


def test_unknown_lora_target_lists_the_available_modules():
    config = tiny_llama_config()
    lora = ru.check_lora_targets(ru.LoraArguments(), config)
    assert set(lora.target_modules) == set(ru.LLAMA_LORA_TARGETS)
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] not found.*available linear modules: \[.*'q_proj'"):
        ru.check_lora_targets(ru.LoraArguments(lora_target_modules=["q_proj", "qkv_proj"]), config)


def test_the_lora_recipe_plans_the_lora_its_flags_give(tmp_path, monkeypatch):
    """recipes/lora.py hands its LoraConfig (--lora_r, --lora_dropout, --lora_target_modules) to the plan."""
    import hf_dist

    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    planned = []

    def auto_args(model, request, **kwargs):
        planned.append(hf_dist.plan(model, request))
        raise KeyboardInterrupt  # the plan is what this test reads: stop before anything trains

    monkeypatch.setattr(hf_dist, "auto_args", auto_args)
    flags = ["--lora_r", "64", "--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj"]
    with pytest.raises(KeyboardInterrupt):
        load_recipe("lora").main([*flags, "--output_dir", str(tmp_path / "out")])
    lora = planned[0].lora
    assert (lora.rank, lora.dropout, lora.targets, lora.source) == (64, 0.0, ("q_proj", "v_proj"), "peft_config")


def test_bitsandbytes_config_is_nf4_double_quant_with_matching_storage():
    import torch

    cfg = ru.bnb_config(ru.QuantArguments(bnb_4bit_compute_dtype="float16"))
    assert cfg.load_in_4bit and not cfg.load_in_8bit
    assert cfg.bnb_4bit_quant_type == "nf4" and cfg.bnb_4bit_use_double_quant
    assert cfg.bnb_4bit_compute_dtype == torch.float16 and cfg.bnb_4bit_quant_storage == torch.float16


def load_recipe(name):
    return ru.load_recipe(REPO_ROOT / "recipes" / f"{name}.py")


def test_qlora_without_gpu_fails_before_loading_anything(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    monkeypatch.setattr(ru, "load_tokenizer", lambda *a, **k: loaded.append("tokenizer"))
    missing = tmp_path / "missing.jsonl"  # would be a FileNotFoundError if data were read first
    with pytest.raises(ru.RecipeRefusal, match=r"recipes/qlora.py needs a CUDA GPU.*use recipes/lora.py") as refused:
        load_recipe("qlora").main(["--dataset", str(missing), "--output_dir", str(tmp_path / "out")])
    assert isinstance(refused.value.__cause__, RuntimeError)
    assert loaded == [] and not (tmp_path / "out").exists()


def test_tokenizer_without_chat_template_gets_the_default(tmp_path, capsys):
    tok = build_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").unlink(missing_ok=True)
    args = ru.ModelArguments(model_name_or_path="unused", tokenizer_name_or_path=str(tmp_path / "tok"))
    loaded = ru.load_tokenizer(args, chat=True)
    assert loaded.chat_template == DEFAULT_CHAT_TEMPLATE
    assert "has no chat template: using hf_dist.data.DEFAULT_CHAT_TEMPLATE" in capsys.readouterr().out


def test_sft_bad_inputs_fail_before_the_model_is_built(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(ru, "build_model", lambda *a, **k: built.append(1))
    sft = load_recipe("sft")
    out = ["--output_dir", str(tmp_path / "out"), "--use_cpu"]
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ru.RecipeRefusal, match=r"columns \['answer', 'question'\]; this recipe expects"):
        sft.main([*out, "--dataset", str(wrong)])
    with pytest.raises(ru.RecipeRefusal, match="missing.jsonl") as refused:
        sft.main([*out, "--dataset", str(tmp_path / "missing.jsonl")])
    assert isinstance(refused.value.__cause__, FileNotFoundError)
    with pytest.raises(ru.RecipeRefusal, match="exceeds the model's max_position_embeddings=256"):
        sft.main([*out, "--max_seq_length", "100000"])
    assert built == []


def test_resume_checkpoint_auto_path_and_none(tmp_path, capsys):
    from types import SimpleNamespace

    from tests.unit.checkpoint.fakes import seal

    args = SimpleNamespace(resume_from_checkpoint=None, output_dir=str(tmp_path), process_index=0,
                           deepspeed=None, fsdp=[])  # fmt: skip
    assert ru.resume_checkpoint(args) is None
    args.resume_from_checkpoint = "auto"
    assert ru.resume_checkpoint(args) is None  # nothing saved yet: a fresh start, said so
    assert "starting from scratch" in capsys.readouterr().out
    for step in (2, 4):  # a DDP-style checkpoint; checkpoint-4 is never marked complete
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
        torch.save({}, folder / "optimizer.pt")  # loaded by auto_resume before it returns the checkpoint
        if step == 2:
            seal(folder, world_size=1, step=2)
    assert ru.resume_checkpoint(args) == str(tmp_path / "checkpoint-2")
    assert f"resuming from {tmp_path / 'checkpoint-2'}" in capsys.readouterr().out
    args.resume_from_checkpoint = str(tmp_path / "checkpoint-4")  # an explicit path is taken as given
    assert ru.resume_checkpoint(args) == str(tmp_path / "checkpoint-4")
    # a fresh run into a folder of another run's checkpoints is refused (before any model is built)
    with pytest.raises(ValueError, match=r"already holds checkpoints of an earlier run \(checkpoint-2, checkpoint-4\)"
                       r".*--resume_from_checkpoint auto.*another --output_dir"):  # fmt: skip
        ru.check_output_dir(str(tmp_path), resuming=False)
    ru.check_output_dir(str(tmp_path), resuming=True)


def test_export_takes_this_runs_last_checkpoint_never_an_older_runs(tmp_path):
    """A re-run that stopped at step 3 exports checkpoint-3, not the earlier run's checkpoint-4 beside it."""
    from types import SimpleNamespace

    from hf_dist.recipe_utils.export import final_checkpoint

    for step in (3, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), state=SimpleNamespace(global_step=3))
    assert final_checkpoint(trainer) == tmp_path / "checkpoint-3"
    trainer.state.global_step = 5  # no save at the last step: gathered in-process instead of an older checkpoint
    assert final_checkpoint(trainer) is None


@pytest.mark.parametrize(
    ("argv", "defaults", "expected"),
    [
        (["--per_device_train_batch_size", "8"], {}, 8),  # the user's 8, which is also transformers' default
        ([], {"per_device_train_batch_size": 8}, 8),  # a recipe default of 8
        (["--per_device_train_batch_size", "3"], {}, 3),
    ],
)
def test_a_micro_batch_the_user_or_recipe_sets_is_honoured_even_when_it_is_8(monkeypatch, argv, defaults, expected):
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    embedded = {**EMBEDDED, **defaults, "per_device_train_batch_size": defaults.get("per_device_train_batch_size", 2)}
    if not defaults:
        embedded.pop("per_device_train_batch_size")
    *_, kwargs, explicit = ru.parse_recipe_args(
        (ru.ModelArguments,), argv, embedded_defaults=embedded, real_defaults=REAL
    )
    config = tiny_llama_config(num_hidden_layers=1)
    args = ru.training_arguments(kwargs, explicit, config, PlanRequest(method="full", seq_len=32, strategy="ddp"))
    assert args.per_device_train_batch_size == expected


def test_without_a_micro_batch_from_user_or_recipe_the_plan_chooses_it(monkeypatch):
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    *_, kwargs, explicit = ru.parse_recipe_args(
        (ru.ModelArguments,), [], embedded_defaults=EMBEDDED, real_defaults=REAL
    )
    assert "per_device_train_batch_size" not in kwargs  # transformers' default 8 is not a choice anyone made
    config = tiny_llama_config(num_hidden_layers=1)
    args = ru.training_arguments(kwargs, explicit, config, PlanRequest(method="full", seq_len=32, strategy="ddp"))
    planned = __import__("hf_dist").auto_args(config, PlanRequest(method="full", seq_len=32, strategy="ddp"))
    assert args.per_device_train_batch_size == planned["per_device_train_batch_size"]


@pytest.mark.parametrize(
    "flags, recipe_defaults",
    [(["--per_device_train_batch_size", "8"], {}), ([], {"per_device_train_batch_size": 8})],
    ids=["command-line", "recipe-default"],
)
def test_micro_batch_of_8_is_honoured_not_taken_for_transformers_default(tmp_path, flags, recipe_defaults):
    """8 is transformers' default; it must still pin the micro batch when the user or the recipe chose it."""
    argv = ["--model_name_or_path", "some/model", "--output_dir", str(tmp_path), *flags]
    *_, kwargs, explicit = ru.parse_recipe_args(
        (ru.ModelArguments,), argv, embedded_defaults={}, real_defaults=recipe_defaults
    )
    args = ru.training_arguments(
        kwargs, explicit, tiny_llama_config(), PlanRequest(method="full", seq_len=32, strategy="ddp")
    )
    assert args.per_device_train_batch_size == 8  # the plan alone would choose a micro batch of 1


def test_cpu_test_mode_and_export_check_are_explicit_flags(tmp_path, monkeypatch):
    """FSDP on CPU is the recipe's --fsdp_on_cpu, never a side effect of building TrainingArguments."""
    from hf_dist.runtime.cpu_fsdp import fsdp_on_cpu_enabled

    monkeypatch.setenv("HF_DIST_FSDP_ON_CPU", "1")  # read by test scripts that opt in; the recipes do not
    _, run_args, kwargs, explicit = parse(["--output_dir", str(tmp_path)], (ru.ModelArguments, ru.RunArguments))
    assert not run_args.fsdp_on_cpu and not run_args.check_export
    ru.training_arguments(
        kwargs, explicit, tiny_llama_config(), PlanRequest(method="full", seq_len=32, strategy="ddp")
    )
    assert not fsdp_on_cpu_enabled()
    _, run_args, _, _ = parse(["--fsdp_on_cpu", "--check_export"], (ru.ModelArguments, ru.RunArguments))
    assert run_args.fsdp_on_cpu and run_args.check_export


def test_results_of_an_unchecked_export_claim_no_reload_or_sample():
    results = {"strategy": "zero3", "wrapped_model": "DeepSpeedEngine", "steps": 8, "world_size": 2,
               "train_losses": [4.6, 4.2], "eval_loss": 4.1, "perplexity": 60.3, "export_dir": "out/final",
               "exported_with": "hf_dist.convert(checkpoint-8)"}  # fmt: skip
    text = ru.format_results(results)
    assert "strategy run: zero3 (DeepSpeedEngine), 8 steps on 2 process(es)" in text
    assert "from_pretrained" not in text and "sample" not in text
    checked = ru.format_results({**results, "sample_prompt": "p", "sample_output": "o"})
    assert "reloaded with from_pretrained" in checked and "[hf_dist] sample: 'p' -> 'o'" in checked
    task = {**results, "sample_prompt": "p", "sample_expected": "cba"}
    assert ru.format_results({**task, "sample_output": " cba\nmore"}).endswith("-> ' cba\\nmore' (right)")
    assert ru.format_results({**task, "sample_output": "abc"}).endswith("-> 'abc' (a miss: expected 'cba')")


def test_deepspeed_on_cpu_ranks_needs_the_explicit_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under a 2-rank CPU launch; nothing is started
    _, kwargs, explicit = parse(["--output_dir", str(tmp_path)], (ru.ModelArguments,))
    with pytest.raises(ValueError, match="pass --deepspeed_on_cpu"):
        ru.training_arguments(
            kwargs, explicit, tiny_llama_config(), PlanRequest(method="full", seq_len=32, strategy="zero3")
        )


def test_model_parallel_flags_reach_the_plan_and_the_loader(monkeypatch):
    """--tp_size pins the plan's TP (auto_args emits its ParallelismConfig and save_only_model) and the model is
    then loaded sharded (the TP plan "auto"); the batch math counts data-parallel ranks, not processes."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig

    from hf_dist.planning.features import installed_features

    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="--tp_size must be a positive int"):
        ru.ModelArguments(tp_size=0)
    model_args, kwargs, explicit = ru.parse_recipe_args(
        (ru.ModelArguments,), ["--tp_size", "2"], embedded_defaults=EMBEDDED, real_defaults=REAL
    )
    request = model_args.plan_request("full", 32)
    assert (request.tp_size, request.cp_size, request.sp_size) == (2, None, None)
    planned = __import__("hf_dist").auto_args(tiny_llama_config(), gpus=2, **{"tp_size": 2, "strategy": "ddp"})
    assert planned["parallelism_config"].tp_size == 2 and planned["save_only_model"] is True
    args = SimpleNamespace(parallelism_config=ParallelismConfig(tp_size=2), deepspeed=None)
    newer = installed_features().tp_distributed_config  # transformers 5.24's form; below it the older keyword
    assert ru.parallel_load_kwargs(args) == (
        {"distributed_config": {"tp_plan": "auto", "tp_size": 2}} if newer else {"tp_plan": "auto"}
    )
    fsdp_tp = SimpleNamespace(
        parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2), deepspeed=None, bf16=True
    )
    assert ru.parallel_load_kwargs(fsdp_tp) == ({"distributed_config": {
        "tp_plan": "auto", "tp_size": 2, "fsdp_size": 2, "dp_replicate_size": 1, "fsdp_mixed_precision": True}}
        if newer else {"tp_plan": "auto"})  # fmt: skip
    assert ru.parallel_load_kwargs(SimpleNamespace(parallelism_config=None, deepspeed=None)) == {}
    args = SimpleNamespace(
        parallelism_config=ParallelismConfig(tp_size=2), world_size=2, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, device=SimpleNamespace(type="cpu"),
    )  # fmt: skip
    text = ru.describe_plan(tiny_llama_config(), method="full", seq_len=32, args=args, strategy="ddp")
    assert "2 process(es) on cpu tp=2: micro batch 4 x grad accum 2 x data parallel 1 = global batch 8" in text
    assert "chosen: ddp tp=2" in text and "tp=2 as asked" in text


def test_a_tp_run_whose_weights_are_not_sharded_is_refused():
    from types import SimpleNamespace

    import torch
    from accelerate.parallelism_config import ParallelismConfig

    from hf_dist.recipe_utils.run import _live_sizes

    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(parallelism_config=ParallelismConfig(tp_size=2)),
        args=SimpleNamespace(deepspeed=None),
        model=torch.nn.Linear(2, 2),
    )
    with pytest.raises(
        RuntimeError,
        match=r"tp_size 2 was requested but no weight is sharded.*hf_dist.from_pretrained_kwargs\(plan.layout\)",
    ):
        _live_sizes(trainer)
    trainer.accelerator.parallelism_config = None
    assert _live_sizes(trainer) == {"tp": 1, "cp": 1, "sp": 1}


def test_deepspeed_autotp_sizes_come_from_the_deepspeed_config():
    """AutoTP has no ParallelismConfig: tp comes from the DeepSpeed config's tensor_parallel.autotp_size, in the batch
    math, the loader (a plain model: DeepSpeed shards it when the engine starts) and the check of what ran."""
    from types import SimpleNamespace

    import torch

    from hf_dist.recipe_utils.run import _live_sizes

    ds = SimpleNamespace(config={"zero_optimization": {"stage": 2}, "tensor_parallel": {"autotp_size": 2}})
    args = SimpleNamespace(
        parallelism_config=None, hf_deepspeed_config=ds, deepspeed={"tensor_parallel": {"autotp_size": 2}},
        world_size=4, per_device_train_batch_size=2, gradient_accumulation_steps=1, device=SimpleNamespace(type="cpu"),
    )  # fmt: skip
    assert ru.parallel_load_kwargs(args) == {}
    text = ru.describe_plan(tiny_llama_config(), method="full", seq_len=32, args=args, strategy="zero2")
    assert "4 process(es) on cpu tp=2: micro batch 2 x grad accum 1 x data parallel 2 = global batch 4" in text
    assert "chosen: zero2 tp=2" in text
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    trainer = SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=None), args=args, deepspeed=None)
    assert _live_sizes(trainer)["tp"] == 2  # before the engine exists: what was configured
    trainer.deepspeed = SimpleNamespace(module=plain)
    with pytest.raises(RuntimeError, match="AutoTP was configured with autotp_size 2 but no layer"):
        _live_sizes(trainer)
    plain[0].tp_world_size = 2  # what DeepSpeed's TensorParallel_Layer carries
    assert _live_sizes(trainer) == {"tp": 2, "cp": 1, "sp": 1}


def test_recipe_sizes_the_users_own_config_does_not_run_are_refused(tmp_path):
    """--tp_size 2 next to the user's --deepspeed JSON without AutoTP trained plain ZeRO-2 and said nothing."""
    from hf_dist.configs.deepspeed import deepspeed_config

    kwargs = {"output_dir": str(tmp_path), "deepspeed": deepspeed_config("zero2"), "report_to": []}
    with pytest.raises(ValueError, match=r"--tp_size 2 asks for what your own strategy config \(deepspeed\) does not "
                       r"run \(tp 1\).*hf-dist config --strategy zero2 --tp-size 2"):  # fmt: skip
        ru.training_arguments(kwargs, {"deepspeed"}, None, PlanRequest(method="full", seq_len=16, tp_size=2))  # fmt: skip
    with_tp = {**kwargs, "deepspeed": deepspeed_config("zero2", tp_size=2)}
    args = ru.training_arguments(with_tp, {"deepspeed"}, None, PlanRequest(method="full", seq_len=16, tp_size=2))  # fmt: skip
    assert args.deepspeed["tensor_parallel"] == {"autotp_size": 2}


def test_the_printed_plan_describes_the_users_own_strategy(tmp_path):
    """--deepspeed ds.json (ZeRO-2) chooses the strategy: the printed plan said 'chosen: ddp' while ZeRO-2 ran."""
    from hf_dist.configs.deepspeed import deepspeed_config
    from hf_dist.testing import tiny_llama_config

    kwargs = {
        "output_dir": str(tmp_path),
        "deepspeed": deepspeed_config("zero2", mixed_precision="no"),
        "report_to": [],
    }
    args = ru.training_arguments(kwargs, {"deepspeed"}, None, PlanRequest(method="full", seq_len=16, strategy=None))
    text = ru.describe_plan(tiny_llama_config(), method="full", seq_len=16, args=args)
    assert "plan: chosen: zero2" in text, text


def test_offload_flags_reach_the_plan(tmp_path, monkeypatch):
    """--offload/--offload_device/--nvme_path pin the plan (ZeRO-Infinity on GPUs); on CPU ranks the plan refuses."""
    import hf_dist

    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(key, raising=False)
    flags = ["--output_dir", str(tmp_path), "--strategy", "zero3", "--offload", "optimizer+params"]
    flags += ["--offload_device", "nvme", "--nvme_path", str(tmp_path)]
    model_args, kwargs, explicit = parse(flags, (ru.ModelArguments,))
    request = model_args.plan_request("full", 32)
    assert (request.strategy, request.offload, request.offload_device) == ("zero3", "optimizer+params", "nvme")
    config = tiny_llama_config(num_hidden_layers=1)
    with pytest.raises(ValueError, match="training already runs on CPU"):  # this machine: CPU ranks
        ru.training_arguments(kwargs, explicit, config, request, nvme_path=model_args.nvme_path)
    seen = {}
    monkeypatch.setattr(hf_dist, "auto_args", lambda model, request, **kw: seen.update(request.given(), **kw) or {})
    ru.training_arguments(kwargs, explicit, config, request, nvme_path=model_args.nvme_path)
    pins = {"offload": "optimizer+params", "offload_device": "nvme", "nvme_path": str(tmp_path)}
    assert {k: seen[k] for k in pins} == pins
    with pytest.raises(ValueError, match="--offload_device 'disk' is not one of cpu, nvme"):
        parse(["--output_dir", str(tmp_path), "--offload_device", "disk"], (ru.ModelArguments,))
