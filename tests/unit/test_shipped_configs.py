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
    "fsdp2_tp2.yaml": (
        "FSDP",
        1,
        8,
        {"parallelism_config": {"parallelism_config_dp_shard_size": 4, "parallelism_config_tp_size": 2}},
    ),
    "fsdp2_cp2.yaml": (
        "FSDP",
        1,
        8,
        {"parallelism_config": {"parallelism_config_dp_shard_size": 4, "parallelism_config_cp_size": 2}},
    ),
    "zero2_sp2.yaml": (
        "DEEPSPEED",
        1,
        8,
        {
            "deepspeed_config": {"zero_stage": 2},
            "parallelism_config": {
                "parallelism_config_sp_size": 2,
                "parallelism_config_sp_backend": "deepspeed",
                "parallelism_config_sp_attn_implementation": "sdpa",
            },
        },
    ),
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


@pytest.mark.parametrize("name", ["fsdp2_tp2.yaml", "fsdp2_cp2.yaml", "zero2_sp2.yaml"])
def test_model_parallel_files_reach_the_launch_environment(name):
    """accelerate launch turns the parallelism_config_* keys into the PARALLELISM_CONFIG_* variables the
    ParallelismConfig of the training processes reads, and builds a mesh that covers all processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig

    from hf_dist.planning.features import check_features, installed_features
    from hf_dist.planning.layout import Layout

    args = launch_command_parser().parse_args(["--config_file", str(SHIPPED_DIR / name), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_parallelism_config
    if name == "zero2_sp2.yaml" and not installed_features().sequence_parallel:
        # accelerate < 1.12 launches DeepSpeed without a mesh (the file says it needs 1.12); hf-dist refuses to write it
        assert "PARALLELISM_CONFIG_SP_SIZE" not in _launch_env(args)
        with pytest.raises(ValueError, match="sp_size 2 needs .*accelerate >= 1.12"):
            check_features(Layout("zero2", 8, sp_size=2), installed_features())
        return
    env = _launch_env(args)
    sizes = {k: int(env[f"PARALLELISM_CONFIG_{k.upper()}_SIZE"]) for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")
             if f"PARALLELISM_CONFIG_{k.upper()}_SIZE" in env}  # fmt: skip
    want = {"fsdp2_tp2.yaml": ("tp", 2), "fsdp2_cp2.yaml": ("cp", 2), "zero2_sp2.yaml": ("sp", 2)}[name]
    assert sizes[want[0]] == want[1]
    pc = ParallelismConfig(**{f"{k}_size": v for k, v in sizes.items()})
    assert pc.total_size == args.num_processes == 8
    if name == "zero2_sp2.yaml":
        assert args.use_deepspeed and env["PARALLELISM_CONFIG_SP_BACKEND"] == "deepspeed"
        assert env["PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"] == "sdpa"
    else:
        assert args.use_fsdp and args.fsdp_version == 2


def _launch_env(args) -> dict[str, str]:
    """The environment ``accelerate launch`` gives the training processes for ``args`` (accelerate >= 1.12 has one
    helper for the mesh variables; 1.10/1.11 set them inside the multi-GPU and DeepSpeed preparers)."""
    from accelerate.utils import launch

    if hasattr(launch, "prepare_extend_env_parallelism_config"):
        return launch.prepare_extend_env_parallelism_config(args, {})
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = []
        return launch.prepare_deepspeed_cmd_env(args)[1]
    return launch.prepare_multi_gpu_env(args)
