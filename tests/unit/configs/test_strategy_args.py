"""One strategy -> kwargs emitter, shared by auto_args, the accelerate YAML and bench; pure factories."""

import ast
import os
from pathlib import Path

import pytest

import hf_dist.configs
from hf_dist.bench import strategy_kwargs
from hf_dist.configs.accelerate import accelerate_config
from hf_dist.configs.training_args import strategy_args
from hf_dist.planning.features import LibraryFeatures
from hf_dist.planning.layout import REGISTRY, Layout
from hf_dist.testing import tiny_llama_config

WORLD = {"hsdp": (16, 2)}


def layout_of(name, **kw):
    world, nodes = WORLD.get(name, (8, 1))
    return Layout(name, world, nodes, **kw)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_strategy_gets_its_engine_and_nothing_else(name):
    s = REGISTRY[name]
    out = strategy_args(layout_of(name, activation_checkpointing=True), wrap_classes=["LlamaDecoderLayer"])
    assert bool(out.get("fsdp")) is s.is_fsdp and ("deepspeed" in out) is s.is_deepspeed
    if s.is_deepspeed:
        assert out["deepspeed"]["zero_optimization"]["stage"] == s.zero_stage
    if s.is_fsdp:  # FSDP checkpoints inside each unit, never through the model's flag
        assert out["fsdp_config"]["activation_checkpointing"] is True and out["activation_checkpointing"] is False
        assert out["fsdp_config"]["reshard_after_forward"] is (not s.gathers_params)
    else:
        assert out["activation_checkpointing"] is True
        assert out["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    assert ("parallelism_config" in out) is s.replicates_across_nodes
    off = strategy_args(layout_of(name), wrap_classes=["LlamaDecoderLayer"])  # no checkpointing: said, not implied
    assert off["activation_checkpointing"] is False and "activation_checkpointing_kwargs" not in off


@pytest.mark.parametrize("name", [n for n, s in REGISTRY.items() if s.is_fsdp])
def test_the_accelerate_yaml_says_what_the_training_args_say(name):
    world, nodes = WORLD.get(name, (8, 1))
    for features in (LibraryFeatures(), LibraryFeatures(fsdp_version=1, fsdp_flag_takes_bool=False)):
        ours = strategy_args(layout_of(name), features=features, wrap_classes=["LlamaDecoderLayer"])["fsdp_config"]
        yaml_cfg = accelerate_config(
            name, num_processes=world, nodes=nodes, wrap_classes=["LlamaDecoderLayer"], features=features
        )
        section = yaml_cfg["fsdp_config"]
        assert section["fsdp_version"] == ours["version"] == features.fsdp_version
        assert section["fsdp_reshard_after_forward"] == ours["reshard_after_forward"]
        assert section["fsdp_offload_params"] == ours["cpu_offload"]
        assert section["fsdp_transformer_layer_cls_to_wrap"] == ",".join(ours["transformer_layer_cls_to_wrap"])


def test_hsdp_mesh_is_the_same_in_yaml_and_training_args():
    emitted = strategy_args(Layout("hsdp", 16, 2))["parallelism_config"]
    yaml_cfg = accelerate_config("hsdp", nodes=2, num_processes=16)["parallelism_config"]
    assert yaml_cfg == {f"parallelism_config_{k}": v for k, v in emitted.items()} != {}


@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp_shard_grad_op"])
def test_bench_uses_the_same_emitter(monkeypatch, name):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = tiny_llama_config()
    from hf_dist.planning.features import installed_features

    expected = strategy_args(
        Layout(name, 2, mixed_precision="no"),
        features=installed_features(),
        wrap_classes=["LlamaDecoderLayer"] if REGISTRY[name].is_fsdp else None,
        cpu_ram_efficient_loading=False,
    )
    from transformers import AutoModelForCausalLM

    assert strategy_kwargs(name, AutoModelForCausalLM.from_config(config), "no", "cpu") == expected


def test_factories_give_the_same_output_without_any_environment(monkeypatch):
    def everything():
        return [
            [strategy_args(layout_of(n, offload=o)) for n, s in REGISTRY.items() for o in s.offloads],
            [accelerate_config(n, nodes=WORLD.get(n, (8, 1))[1]) for n in REGISTRY],
        ]

    before = everything()
    for key in list(os.environ):
        monkeypatch.delenv(key)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what a launcher would set: factories must not care
    assert everything() == before


def test_configs_package_reads_no_environment_and_no_library_source():
    for path in Path(hf_dist.configs.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        imports = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "environ" not in names and "getenv" not in names, path.name
        assert "inspect" not in imports and "getsource" not in names, path.name
        assert not {"hf_dist.planning.planner", "hf_dist.planning.wrap"} & modules, path.name
