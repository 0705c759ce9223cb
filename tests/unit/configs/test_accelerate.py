"""accelerate_config factory, commented-YAML writer and atomic writes."""

import pytest
import yaml

from hf_dist.atomic_io import atomic_write_text
from hf_dist.configs.accelerate import accelerate_config, to_yaml, write_yaml


def test_ddp_single_node_defaults():
    cfg = accelerate_config("ddp")
    assert cfg["distributed_type"] == "MULTI_GPU"
    assert (cfg["num_machines"], cfg["num_processes"]) == (1, 8)
    assert "main_process_ip" not in cfg and "fsdp_config" not in cfg


def test_fsdp_wrap_classes_and_activation_checkpointing():
    cfg = accelerate_config("fsdp_full_shard", wrap_classes=["A", "B"], activation_checkpointing=True, num_processes=4)
    fsdp = cfg["fsdp_config"]
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "A,B"
    assert fsdp["fsdp_activation_checkpointing"] is True
    assert cfg["num_processes"] == 4


def test_multi_node_fields():
    cfg = accelerate_config("zero3", nodes=2, num_processes=16, main_process_ip="10.1.2.3")
    assert cfg["num_machines"] == 2 and cfg["machine_rank"] == 0
    assert cfg["main_process_ip"] == "10.1.2.3" and cfg["main_process_port"] == 29500
    assert cfg["rdzv_backend"] == "static"
    assert cfg["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"


def test_deepspeed_config_file_form_drops_conflicting_keys():
    cfg = accelerate_config("zero2", deepspeed_config_file="ds.json")
    assert cfg["deepspeed_config"] == {"deepspeed_config_file": "ds.json", "zero3_init_flag": False}
    assert "mixed_precision" not in cfg  # accelerate refuses mixed_precision next to a DeepSpeed JSON


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategy": "tp"}, "unknown strategy 'tp'; allowed: ddp, zero1"),
        ({"strategy": "hsdp"}, "hsdp replicates across nodes and needs nodes >= 2"),
        (
            {"strategy": "ddp", "offload": "optimizer"},
            "strategy 'ddp' does not support offload 'optimizer'; allowed: none",
        ),
        (
            {"strategy": "zero2", "offload": "optimizer+params"},
            r"Strategies that offload 'optimizer\+params': zero3, fsdp_full_shard, hsdp",
        ),
        (
            {"strategy": "ddp", "nodes": 2, "num_processes": 3},
            r"num_processes \(3\) must be a positive multiple of nodes \(2\)",
        ),
        ({"strategy": "ddp", "nodes": 0}, "nodes must be a positive integer"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accelerate_config(**kwargs)


def test_yaml_round_trip_with_comments():
    cfg = accelerate_config("hsdp", nodes=2, wrap_classes=["LlamaDecoderLayer"])
    text = to_yaml(cfg, "header line")
    assert text.startswith("# header line\n")
    assert yaml.safe_load(text) == cfg
    assert all("  # " in line for line in text.splitlines() if not line.startswith("#"))


def test_unknown_key_has_no_comment():
    with pytest.raises(ValueError, match="no comment for accelerate config key 'made_up'"):
        to_yaml({"made_up": 1})


def test_atomic_write_refuses_overwrite(tmp_path):
    path = tmp_path / "a.yaml"
    write_yaml(accelerate_config("ddp"), path)
    before = path.read_text()
    with pytest.raises(FileExistsError, match="already exists; pass --force"):
        write_yaml(accelerate_config("zero1"), path)
    assert path.read_text() == before
    write_yaml({"debug": True}, path, force=True)
    assert path.read_text().startswith("debug: true")
    atomic_write_text(path, "x: 1\n")
    assert path.read_text() == "x: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.yaml"]  # no temp file left behind
