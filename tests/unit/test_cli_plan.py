"""`hf-dist plan` and `hf-dist env` through the real entry point."""

import dataclasses
import json

import pytest

from hf_dist.cli.main import PIPE_CLOSED_EXIT, main
from hf_dist.testing import tiny_llama_config


def test_plan_folder_table(tmp_path, capsys):
    tiny_llama_config().save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--global-batch", "64"]) == 0
    out = capsys.readouterr().out
    assert "chosen: ddp" in out and "CHOSEN" in out  # a 0.1M-param model needs no sharding
    assert "global_batch 64" in out and "zero3" in out and "fsdp_full_shard" in out


def test_plan_config_json_as_json(tmp_path, capsys):
    tiny_llama_config().save_pretrained(tmp_path)
    args = ["plan", str(tmp_path / "config.json"), "--gpus", "2", "--gpu-memory", "24", "--method", "lora"]
    assert main([*args, "--seq-len", "128", "--micro-batch", "2", "--global-batch", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "lora" and data["seq_len"] == 128
    assert (data["micro_batch_size"], data["gradient_accumulation_steps"], data["world_size"]) == (2, 2, 2)
    assert data["hardware"]["gpu_memory_gib"] == 24.0 and data["mixed_precision"] == "bf16"


def test_plan_lora_flags_plan_that_lora(tmp_path, capsys):
    """--lora-rank/--lora-dropout/--lora-targets (method lora without --method): what PEFT would train."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    tiny_llama_config().save_pretrained(tmp_path)
    base = ["plan", str(tmp_path), "--gpus", "1", "--gpu-memory", "80", "--json"]
    assert main([*base, "--lora-rank", "64", "--lora-dropout", "0", "--lora-targets", "q_proj", "v_proj"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "lora" and data["lora"]["source"] == "keywords"
    assert (data["lora"]["r"], data["lora"]["lora_dropout"], data["lora"]["target_modules"]) == (
        64, 0.0, ["q_proj", "v_proj"])  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    model = peft.get_peft_model(model, peft.LoraConfig(r=64, target_modules=["q_proj", "v_proj"]))
    assert data["trainable_params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert main([*base, "--lora-targets", "all-linear"]) == 0
    assert json.loads(capsys.readouterr().out)["lora"]["target_modules"] == "all-linear"
    assert main([*base, "--lora-targets", "qkv_proj"]) == 1
    assert "target_modules name 'qkv_proj' matches no module of the model" in capsys.readouterr().err
    assert main([*base, "--method", "full", "--lora-rank", "8"]) == 1
    assert "method='full' trains every weight, but lora_rank describes LoRA adapters" in capsys.readouterr().err


def test_plan_two_nodes(tmp_path, capsys):
    tiny_llama_config().save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus", "16", "--nodes", "2", "--gpu-memory", "80", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nodes"] == 2 and any(c["strategy"] == "hsdp" for c in data["candidates"])


def test_plan_errors_exit_1_with_message(tmp_path, capsys):
    assert main(["plan", "no-such-org/no-such-model", "--gpus", "8", "--gpu-memory", "80"]) == 1
    assert "could not be resolved" in capsys.readouterr().err
    tiny_llama_config().save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus", "10", "--nodes", "4", "--gpu-memory", "80"]) == 1
    assert "not divisible by nodes" in capsys.readouterr().err
    pinned = ["--tp-size", "1", "--cp-size", "1", "--sp-size", "1"]  # data parallelism only
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--global-batch", "12", *pinned]) == 1
    assert "not divisible by world size (8)" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--global-batch", "12"]) == 1  # was cp=2
    assert "use global_batch_size 8 or 16 (a multiple of 8)" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--tp-size", "3"]) == 1
    assert "no layout runs tp_size=3" in capsys.readouterr().err


def test_env_text_and_json(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "bf16 / fp16" in out and "NCCL_DEBUG=INFO" in out
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["versions"]["torch"] and data["hardware"]["device"] == "cpu"
    assert data["interconnect"]["nccl_env"]["NCCL_DEBUG"] == "INFO"


def test_env_infiniband_listing(tmp_path):
    from hf_dist.cli.env import interconnect

    (tmp_path / "mlx5_0").mkdir()
    info = interconnect(env={"NCCL_IB_HCA": "mlx5", "PATH": "/bin"}, sys_ib=str(tmp_path))
    assert info["infiniband_devices"] == ["mlx5_0"] and info["nccl_env"] == {"NCCL_IB_HCA": "mlx5"}


def test_plan_fused_lm_head_and_host_ram_at_load(tmp_path, capsys):
    from hf_dist.testing import public_config

    public_config("llama-3-8b").save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--seq-len", "8192"]
    assert main([*args, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*args, "--fused-lm-head", "--json"]) == 0
    fused = json.loads(capsys.readouterr().out)
    assert fused["fused_lm_head"] is True and fused["memory"]["logits"] < full["memory"]["logits"] / 2
    assert fused["load"]["ranks_per_node"] == 8
    assert main([*args, "--fused-lm-head"]) == 0
    out = capsys.readouterr().out
    assert "loss through TRL's fused LM head" in out and "host RAM at load: " in out


def test_nothing_fits_is_one_finding_a_line(tmp_path, capsys):
    from hf_dist.testing import public_config

    public_config("llama-3-70b").save_pretrained(tmp_path / "llama-3-70b")
    assert main(["plan", str(tmp_path / "llama-3-70b"), "--gpus", "2", "--gpu-memory", "80"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "hf-dist plan: error: nothing fits on 2 x 80 GiB:"
    assert lines[1].startswith("  - the smallest candidate (ddp/none tp=2, micro_batch=1) needs 595.93 GiB per rank")
    assert lines[-1] == (
        "  - it would fit on at least 32 GPUs of 80 GiB (4 node(s)) with zero3, offload=none, "
        "activation_checkpointing=True"
    )
    assert all(line.startswith("  - ") for line in lines[1:]) and max(map(len, lines)) < 220


def test_plan_time_to_finish(tmp_path, capsys):
    from hf_dist.testing import public_config

    public_config("llama-3-8b").save_pretrained(tmp_path)
    args = [
        "plan",
        str(tmp_path),
        "--gpus",
        "8",
        "--gpu-memory",
        "80",
        "--global-batch",
        "64",
        "--train-tokens",
        "2e9",
    ]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    seconds = 2e9 / data["tokens_per_s"]
    assert data["train_tokens"] == 2_000_000_000
    assert data["time_to_finish"] == {
        "seconds": pytest.approx(seconds),
        "gpu_hours": pytest.approx(seconds * 8 / 3600),
    }
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("time to finish: "))
    assert line.startswith(
        f"time to finish: 2e+09 tokens in ~{seconds / 3600:.1f} h ({seconds * 8 / 3600:,.0f} GPU-hours)"
    )
    assert "(alternatives: " in line and "perf/eta_s" in line
    assert main([*args[:-1], "-5"]) == 1
    assert "train_tokens must be a positive number of tokens" in capsys.readouterr().err


def test_plan_async_save_counts_the_staging_copy(tmp_path, capsys):
    from hf_dist.testing import public_config

    public_config("llama-3-8b").save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--host-memory", "512", "--async-save"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["staging_bytes"] is not None
    assert main(args) == 0
    assert "host RAM for async_save's staging copy: " in capsys.readouterr().out


def test_plan_pinned_to_nvme_states_the_swap_files(tmp_path, capsys, monkeypatch):
    from hf_dist.testing import public_config

    monkeypatch.chdir(tmp_path)
    public_config("llama-3-70b").save_pretrained("llama-3-70b")
    args = ["plan", "./llama-3-70b", "--gpus", "8", "--gpu-memory", "80", "--offload-device", "nvme"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert (
        "chosen: zero3, offload=optimizer to NVMe" in text or "chosen: zero3, offload=optimizer+params to NVMe" in text
    )
    assert "NVMe swap files: " in text and " per node under nvme_path" in text
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["offload_device"] == "nvme" and data["swap_bytes"] == 8 * data["memory"]["swap"] > 0
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["plan", "./llama-3-70b", "--gpus", "8", "--gpu-memory", "80", "--offload-device", "disk"])
    assert "invalid choice: 'disk' (choose from 'cpu', 'nvme')" in capsys.readouterr().err


# PLAN_KEYS that cannot be a flag, and why
NOT_A_FLAG = {
    "hardware": "a Hardware object; the CLI builds it from --gpus, --gpu-memory, --nodes, --host-memory, --nvme-gbps",
    "peft_config": "a PEFT LoraConfig object; the CLI plans the LoRA of --lora-rank, --lora-dropout, --lora-targets",
}
# a value for each flag that differs from its default, and the value the planner keyword then receives
FLAG_VALUES = {
    "lora_dropout": (["--lora-dropout", "0.1"], 0.1),
    "lora_targets": (["--lora-targets", "q_proj", "v_proj"], ["q_proj", "v_proj"]),
    "sync_each_batch": (["--sync-each-batch", "on"], True),
    "gpus": (["--gpus", "4"], 4),
    "gpu_memory_gib": (["--gpu-memory", "40"], 40.0),
    "nodes": (["--nodes", "2"], 2),
    "method": (["--method", "lora"], "lora"),
    "seq_len": (["--seq-len", "512"], 512),
    "global_batch_size": (["--global-batch", "32"], 32),
    "micro_batch_size": (["--micro-batch", "2"], 2),
    "optimizer": (["--optimizer", "sgd"], "sgd"),
    "lora_rank": (["--lora-rank", "8"], 8),
    "strategy": (["--strategy", "zero3"], "zero3"),
    "offload": (["--offload", "optimizer"], "optimizer"),
    "activation_checkpointing": (["--activation-checkpointing", "on"], True),
    "use_liger_kernel": (["--liger", "off"], False),
    "safety_margin": (["--safety-margin", "0.2"], 0.2),
    "pure_bf16": (["--pure-bf16"], True),
    "tp_size": (["--tp-size", "2"], 2),
    "cp_size": (["--cp-size", "1"], 1),
    "sp_size": (["--sp-size", "1"], 1),
    "host_memory_gib": (["--host-memory", "256"], 256.0),
    "nvme_gbps": (["--nvme-gbps", "6"], 6.0),
    "offload_device": (["--offload-device", "cpu"], "cpu"),
    "fused_lm_head": (["--fused-lm-head"], True),
    "async_save": (["--async-save"], True),
    "train_tokens": (["--train-tokens", "2e9"], 2e9),
    "verify": (["--verify"], True),
    "verify_time_limit_s": (["--verify-time-limit", "30"], 30.0),
}


def test_plan_has_a_flag_for_every_pin_auto_args_accepts(tmp_path, monkeypatch):
    """Every planner keyword of auto_args (PLAN_KEYS) is a flag of `hf-dist plan` that reaches the planner (or the
    hardware it plans for) with the value given; a new PLAN_KEY without a flag fails here."""
    import hf_dist.planning.hardware as hardware
    import hf_dist.tracing.checked_plan as checked_plan
    from hf_dist.configs.request import PLAN_KEYS

    assert set(PLAN_KEYS) == set(FLAG_VALUES) | set(NOT_A_FLAG), "a PLAN_KEY without a flag (or a stale entry)"
    received = {}

    class Done(Exception):
        pass

    def fake_detect(**kwargs):
        received.update(kwargs)
        return "hw"

    def fake_plan(spec, request, **kwargs):
        received.update({f.name: getattr(request, f.name) for f in dataclasses.fields(request)})
        raise Done

    monkeypatch.setattr(hardware, "detect_hardware", fake_detect)
    monkeypatch.setattr(checked_plan, "plan", fake_plan)
    tiny_llama_config().save_pretrained(tmp_path)
    argv = [flag for flags, _ in FLAG_VALUES.values() for flag in flags]
    with pytest.raises(Done):
        main(["plan", str(tmp_path), *argv])
    assert received["hardware"] == "hw"
    assert {key: received[key] for key in FLAG_VALUES} == {key: value for key, (_, value) in FLAG_VALUES.items()}


def test_plan_strategy_pin_is_planned_and_a_bad_one_lists_the_names(tmp_path, capsys):
    tiny_llama_config().save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--global-batch", "64", "--json"]
    assert main([*args, "--strategy", "zero3", "--activation-checkpointing", "off"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["strategy"] == "zero3" and {c["strategy"] for c in data["candidates"]} == {"zero3"}
    assert not any(c["activation_checkpointing"] for c in data["candidates"])
    with pytest.raises(SystemExit):
        main([*args, "--strategy", "zero4"])
    err = capsys.readouterr().err
    assert "--strategy: invalid choice: 'zero4'" in err and "fsdp_full_shard" in err


def test_plan_help_examples_of_the_pins_run(tmp_path, capsys):
    """The --help examples of --strategy / --offload / --activation-checkpointing, on a small model folder."""
    from hf_dist.cli.plan import EPILOG

    tiny_llama_config().save_pretrained(tmp_path)
    examples = [line.split("#")[0].split()[2:] for line in EPILOG.splitlines() if "--strategy" in line]
    assert len(examples) == 2
    for argv in examples:
        assert main(["plan", str(tmp_path), *argv[1:], "--json"]) == 0, argv
        data = json.loads(capsys.readouterr().out)
        assert data["strategy"] == "zero3", argv
    assert data["offload"] == "optimizer" and data["activation_checkpointing"] is True


def test_plan_refuses_a_seq_len_beyond_the_positions_in_one_line(tmp_path, capsys):
    tiny_llama_config().save_pretrained(tmp_path)  # 256 positions
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-memory", "80", "--seq-len", "100000"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    refusal = "hf-dist plan: error: seq_len 100000 exceeds the model's max_position_embeddings=256"
    assert captured.err.startswith(refusal)


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (["plan", "{model}", "--gpus", "8", "--gpu-memory", "80"], PIPE_CLOSED_EXIT),
        (["--help"], 0),  # argparse drops a failed write of its help itself
    ],
)
def test_a_closed_pipe_ends_the_cli_quietly(tmp_path, args, status):
    """`hf-dist plan ... | head` once head has gone: no `error: [Errno 32] Broken pipe`, no traceback, no
    "Exception ignored" from the interpreter's last flush; the exit status a shell gives a tool SIGPIPE stopped."""
    import os
    import subprocess
    import sys

    from hf_dist.testing import REPO_ROOT

    tiny_llama_config().save_pretrained(tmp_path)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        command = [sys.executable, "-m", "hf_dist.cli.main", *(a.format(model=tmp_path) for a in args)]
        done = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, timeout=300)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (status, "")
