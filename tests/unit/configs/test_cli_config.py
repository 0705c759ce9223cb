"""`hf-dist config`: writes what the factories make, atomically, and refuses bad input."""

import json
import re

import pytest
import yaml

from hf_dist.cli.main import main
from hf_dist.configs.accelerate import accelerate_config
from hf_dist.configs.deepspeed import deepspeed_config


def test_writes_accelerate_yaml(tmp_path, capsys):
    out = tmp_path / "z.yaml"
    assert main(["config", "--strategy", "zero3", "--offload", "optimizer+params", "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == accelerate_config("zero3", offload="optimizer+params")
    assert "hf-dist config --strategy zero3 --offload optimizer+params" in out.read_text()


def test_nodes_and_num_processes(tmp_path):
    out = tmp_path / "h.yaml"
    assert main(["config", "--strategy", "hsdp", "--nodes", "4", "--num-processes", "32", "--out", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 4,
        "parallelism_config_dp_shard_size": 8,
    }
    assert (cfg["num_machines"], cfg["num_processes"]) == (4, 32)


def test_deepspeed_json(tmp_path):
    out = tmp_path / "ds.json"
    assert main(["config", "--strategy", "zero2", "--format", "deepspeed", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == deepspeed_config("zero2")


def test_stdout_when_no_out(capsys):
    assert main(["config", "--strategy", "ddp"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == accelerate_config("ddp")


def test_refuses_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "c.yaml"
    out.write_text("keep me\n")
    assert main(["config", "--strategy", "ddp", "--out", str(out)]) == 1
    assert "already exists; pass --force" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"
    assert main(["config", "--strategy", "ddp", "--out", str(out), "--force"]) == 0
    assert yaml.safe_load(out.read_text())["distributed_type"] == "MULTI_GPU"


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--strategy", "pipeline"],
            "unknown strategy 'pipeline'; allowed: ddp, zero1, zero2, zero3, fsdp_full_shard",
        ),
        (["--strategy", "ddp", "--format", "deepspeed"], "--format deepspeed needs a ZeRO strategy"),
        (
            ["--strategy", "zero1", "--offload", "optimizer+params"],
            "Strategies that offload 'optimizer+params': zero3",
        ),
    ],
)
def test_errors(argv, message, capsys):
    assert main(["config", *argv]) == 1
    assert message in capsys.readouterr().err


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    assert "examples:" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, key, want",
    [
        (["--strategy", "fsdp_full_shard", "--tp-size", "2"], "parallelism_config_tp_size", 2),
        (["--strategy", "fsdp_full_shard", "--cp-size", "2"], "parallelism_config_cp_size", 2),
        (["--strategy", "zero2", "--sp-size", "2"], "parallelism_config_sp_size", 2),
    ],
)
def test_model_parallel_sizes_in_the_yaml(tmp_path, flags, key, want):
    out = tmp_path / "mp.yaml"
    assert main(["config", *flags, "--out", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["parallelism_config"][key] == want
    sizes = {f[2:].replace("-", "_"): int(v) for f, v in zip(flags[2::2], flags[3::2], strict=True)}
    assert cfg == accelerate_config(flags[1], **sizes)
    assert " ".join(flags[2:]) in out.read_text()  # the header says how to regenerate it


def test_nvme_deepspeed_json(tmp_path):
    out = tmp_path / "ds.json"
    flags = ["--strategy", "zero3", "--offload", "optimizer+params", "--offload-device", "nvme"]
    assert main(["config", *flags, "--nvme-path", "/local_nvme", "--format", "deepspeed", "--out", str(out)]) == 0
    cfg = json.loads(out.read_text())
    assert cfg == deepspeed_config("zero3", offload="optimizer+params", offload_device="nvme", nvme_path="/local_nvme")
    assert cfg["zero_optimization"]["offload_param"]["nvme_path"] == "/local_nvme" and "aio" in cfg


def test_nvme_in_the_accelerate_yaml(tmp_path):
    out = tmp_path / "nvme.yaml"
    flags = ["--strategy", "zero3", "--offload", "optimizer", "--offload-device", "nvme", "--nvme-path", "/nv"]
    assert main(["config", *flags, "--out", str(out)]) == 0
    section = yaml.safe_load(out.read_text())["deepspeed_config"]
    assert section["offload_optimizer_device"] == "nvme" and section["offload_optimizer_nvme_path"] == "/nv"
    assert section["offload_param_device"] == "none"


def test_autotp_json(tmp_path):
    out = tmp_path / "tp.json"
    assert main(["config", "--strategy", "zero2", "--tp-size", "2", "--format", "deepspeed", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["tensor_parallel"] == {"autotp_size": 2}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--strategy", "zero3", "--offload", "optimizer", "--offload-device", "nvme"], "needs nvme_path"),
        (
            ["--strategy", "zero3", "--offload", "optimizer", "--offload-device", "nvme", "--format", "deepspeed"],
            "needs nvme_path",
        ),
        (["--strategy", "zero2", "--offload", "optimizer", "--offload-device", "nvme", "--nvme-path", "/n"], "zero3"),
        (["--strategy", "zero3", "--cp-size", "2"], "context parallelism .* only with FSDP2"),
        (["--strategy", "zero3", "--cp-size", "2", "--format", "deepspeed"], "only with FSDP2"),
        (["--strategy", "fsdp_full_shard", "--sp-size", "2"], "runs only with DeepSpeed"),
        (["--strategy", "zero3", "--tp-size", "2", "--format", "deepspeed"], "AutoTP runs with ZeRO stage <= 2"),
        (["--strategy", "zero2", "--tp-size", "2"], "inline DeepSpeed keys cannot set"),
        (["--strategy", "zero3", "--sp-size", "2"], "sequence_parallel_size.*inline DeepSpeed keys cannot set"),
        (["--strategy", "fsdp_full_shard", "--tp-size", "3"], "does not divide"),
        (["--strategy", "ddp", "--deepspeed-config-file", "ds.json"], "needs a ZeRO strategy"),
        (["--strategy", "fsdp_full_shard", "--tp-size", "16", "--nodes", "2"], "only runs inside a node"),
        (["--strategy", "zero2", "--tp-size", "2", "--sp-size", "2", "--format", "deepspeed"], "do not compose"),
        (
            ["--strategy", "zero2", "--tp-size", "2", "--num-processes", "3", "--format", "deepspeed"],
            "does not divide",
        ),
        (
            ["--strategy", "zero3", "--offload", "optimizer", "--nvme-path", "/n"],
            "used only with --offload-device nvme",
        ),
        (["--strategy", "zero3", "--deepspeed-config-file", "missing.json"], "missing.json does not exist"),
    ],
)
def test_bad_model_parallel_input_is_refused(flags, message, capsys):
    assert main(["config", *flags]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_autotp_yaml_references_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "tp.yaml"
    flags = ["--strategy", "zero2", "--tp-size", "2", "--deepspeed-config-file", "ds_autotp.json"]
    assert main(["config", *flags, "--out", str(out)]) == 1  # the JSON must be written first
    assert "ds_autotp.json does not exist" in capsys.readouterr().err
    assert main(["config", "--strategy", "zero2", "--format", "deepspeed", "--out", "ds_autotp.json"]) == 0
    assert main(["config", *flags, "--out", str(out)]) == 1  # a JSON without AutoTP: not what the YAML says
    assert (
        "has autotp_size 1 and sequence_parallel_size 1, but this config asks for --tp-size 2"
        in capsys.readouterr().err
    )
    flags_json = [
        "--strategy",
        "zero2",
        "--tp-size",
        "2",
        "--format",
        "deepspeed",
        "--out",
        "ds_autotp.json",
        "--force",
    ]
    assert main(["config", *flags_json]) == 0
    assert main(["config", *flags, "--out", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["deepspeed_config"]["deepspeed_config_file"] == "ds_autotp.json" and "mixed_precision" not in cfg
    assert "--deepspeed-config-file ds_autotp.json" in out.read_text()


def test_a_written_config_names_its_own_path_in_the_launch_line(tmp_path):
    out = tmp_path / "z3.yaml"
    assert main(["config", "--strategy", "zero3", "--out", str(out)]) == 0
    assert f"# Launch: accelerate launch --config_file {out} train.py" in out.read_text()
