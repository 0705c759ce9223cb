"""Every file in accelerate_configs/ equals what the factories generate and loads through accelerate's loader."""

from pathlib import Path

import pytest
import yaml

from hf_dist.configs.accelerate import SHIPPED, accelerate_config, shipped_configs

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "accelerate_configs"
GENERATED = shipped_configs()

# file -> (distributed_type, num_machines, num_processes, extra checks on the loaded ClusterConfig)
EXPECTED = {
    "ddp.yaml": ("MULTI_GPU", 1, 8, {}),
    "fsdp2_full_shard.yaml": ("FSDP", 1, 8, {"fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}}),
    "fsdp2_shard_grad_op.yaml": ("FSDP", 1, 8, {"fsdp_config": {"fsdp_reshard_after_forward": False}}),
    "hsdp_2node.yaml": (
        "FSDP",
        2,
        16,
        {"parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 8}},
    ),
    "zero1.yaml": ("DEEPSPEED", 1, 8, {"deepspeed_config": {"zero_stage": 1, "offload_optimizer_device": "none"}}),
    "zero2.yaml": ("DEEPSPEED", 1, 8, {"deepspeed_config": {"zero_stage": 2}}),
    "zero3.yaml": ("DEEPSPEED", 1, 8, {"deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True}}),
    "zero3_offload.yaml": (
        "DEEPSPEED",
        1,
        8,
        {"deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}},
    ),
    "multi_node_template.yaml": ("MULTI_GPU", 2, 16, {"main_process_port": 29500, "rdzv_backend": "static"}),
}


def test_every_shipped_file_is_generated_and_expected():
    on_disk = {p.name for p in SHIPPED_DIR.glob("*.yaml")}
    assert on_disk == set(SHIPPED) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_file_matches_factory(name):
    text = (SHIPPED_DIR / name).read_text()
    assert text == GENERATED[name], (
        f"{name} is stale; run: python -m hf_dist.configs.accelerate --write-shipped accelerate_configs/"
    )
    assert yaml.safe_load(text) == accelerate_config(**SHIPPED[name])


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_key_has_a_comment(name):
    for line in (SHIPPED_DIR / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "  # " in line, f"{name}: key without a comment: {line!r}"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_loads_through_accelerate_loader(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    cfg = load_config_from_file(str(SHIPPED_DIR / name))
    assert isinstance(cfg, ClusterConfig)
    dist_type, machines, procs, extra = EXPECTED[name]
    assert cfg.distributed_type.value == dist_type
    assert (cfg.num_machines, cfg.num_processes) == (machines, procs)
    assert cfg.mixed_precision == "bf16"
    for key, want in extra.items():
        got = getattr(cfg, key)
        if isinstance(want, dict):
            assert {k: got.get(k) for k in want} == want, f"{name}: {key}"
        else:
            assert got == want
    if machines > 1:
        assert cfg.machine_rank == 0 and cfg.main_process_ip and cfg.main_process_port


@pytest.mark.parametrize("name", ["fsdp2_full_shard.yaml", "zero3_offload.yaml", "hsdp_2node.yaml"])
def test_accelerate_launch_parser_accepts_it(name):
    """accelerate launch's own validation (config merged into launch args) accepts the file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(SHIPPED_DIR / name), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if name.startswith("fsdp"):
        assert args.use_fsdp and args.fsdp_version == 2
    if name.startswith("zero"):
        assert args.use_deepspeed and args.zero_stage == 3 and args.offload_param_device == "cpu"
    if name.startswith("hsdp"):
        assert args.use_parallelism_config and args.parallelism_config_dp_replicate_size == 2
