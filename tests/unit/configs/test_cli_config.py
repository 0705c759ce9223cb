"""`hf-dist config`: writes what the factories make, atomically, and refuses bad input."""

import json

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
        (["--strategy", "zero1", "--offload", "optimizer+params"], "needs zero3"),
    ],
)
def test_errors(argv, message, capsys):
    assert main(["config", *argv]) == 1
    assert message in capsys.readouterr().err


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    assert "examples:" in capsys.readouterr().out
