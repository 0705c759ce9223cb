"""Configs for tensor / context / sequence parallelism and NVMe offload, from the same Layout; bad input refused."""

import dataclasses
import json

import pytest

from hf_dist.configs.deepspeed import AIO_DEFAULTS, deepspeed_config
from hf_dist.configs.training_args import from_pretrained_kwargs, parallelism_kwargs, strategy_args
from hf_dist.planning.features import LibraryFeatures, installed_features
from hf_dist.planning.layout import Layout

# FSDP2 x TP with data-parallel ranks is loaded by transformers >= 5.23's DistributedConfig; older versions refuse it
# (test_a_tp_layout_the_load_cannot_give_is_refused, and auto_args below)
NEEDS_TP_LOAD = pytest.mark.skipif(
    not installed_features().tp_distributed_config,
    reason="FSDP2 x TP with data-parallel ranks needs transformers 5.23",
)


def test_auto_args_refuses_fsdp2_x_tp_where_transformers_cannot_load_it(plan_with_layout):
    from hf_dist.auto import auto_args
    from hf_dist.testing import tiny_llama_config

    if installed_features().tp_distributed_config:
        pytest.skip("this transformers loads FSDP2 x TP (test_auto_args_builds_the_fsdp_tp_parallelism_config)")
    p, _ = plan_with_layout("fsdp_full_shard", tp_size=2)
    with pytest.raises(ValueError, match="tp_size 2 with 2 data-parallel ranks needs transformers >= 5.23"):
        auto_args(tiny_llama_config(), plan=p)


def test_fsdp2_x_tp_emits_parallelism_config_and_tp_plan():
    layout = Layout("fsdp_full_shard", 8, tp_size=2)
    out = strategy_args(layout, wrap_classes=["LlamaDecoderLayer"])
    assert out["fsdp"] and out["parallelism_config"] == {"dp_replicate_size": 1, "dp_shard_size": 4, "tp_size": 2}
    # every size named: transformers' tp_size defaults to WORLD_SIZE, and its FSDP2 (applied at load) to none
    assert from_pretrained_kwargs(layout) == {
        "distributed_config": {
            "tp_plan": "auto",
            "tp_size": 2,
            "fsdp_size": 4,
            "dp_replicate_size": 1,
            "fsdp_mixed_precision": True,
        }
    }
    # transformers refuses to checkpoint the optimizer of a model sharded at load: weights only, said up front
    assert out["save_only_model"] is True
    assert "save_only_model" not in strategy_args(Layout("fsdp_full_shard", 8))
    assert "save_only_model" not in strategy_args(Layout("zero1", 8, tp_size=2))  # AutoTP shards after load


def test_tp_alone_under_ddp():
    layout = Layout("ddp", 2, tp_size=2)
    assert strategy_args(layout)["parallelism_config"] == {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 2}
    assert from_pretrained_kwargs(layout) == {"distributed_config": {"tp_plan": "auto", "tp_size": 2}}


def test_the_load_names_the_same_mesh_as_the_trainer():
    """HSDP x TP on 2 nodes of 8: transformers' (dp_replicate, fsdp, tp) mesh is accelerate's ParallelismConfig; in
    fp32 or pure bf16 FSDP2 gathers the weights as they are."""
    layout = Layout("hsdp", 16, nodes=2, tp_size=2)
    mesh = strategy_args(layout, wrap_classes=["LlamaDecoderLayer"])["parallelism_config"]
    load = from_pretrained_kwargs(layout)["distributed_config"]
    assert (load["dp_replicate_size"], load["fsdp_size"], load["tp_size"]) == (
        mesh["dp_replicate_size"], mesh["dp_shard_size"], mesh["tp_size"]) == (2, 4, 2)  # fmt: skip
    for precision in (dict(mixed_precision="no"), dict(pure_bf16=True)):
        assert (
            "fsdp_mixed_precision"
            not in from_pretrained_kwargs(Layout("fsdp_full_shard", 8, tp_size=2, **precision))["distributed_config"]
        )


@pytest.mark.parametrize(
    "layout, features, refused",
    [
        (dict(strategy="fsdp_shard_grad_op", tp_size=2), LibraryFeatures(),
         "fsdp_shard_grad_op: under FSDP2 x TP transformers applies FSDP2 as it loads the model and reshards every"),
        (dict(strategy="fsdp_full_shard", tp_size=2), LibraryFeatures(tp_distributed_config=False),
         "tp_size 2 with 4 data-parallel ranks needs transformers >= 5.23"),
    ],
)  # fmt: skip
def test_a_tp_layout_the_load_cannot_give_is_refused(layout, features, refused):
    from hf_dist.planning.features import check_features

    with pytest.raises(ValueError, match=refused):
        check_features(Layout(world_size=8, **layout), features)
    check_features(Layout("ddp", 2, tp_size=2), LibraryFeatures(tp_distributed_config=False))  # TP over every rank


def test_tp_load_keywords_follow_the_installed_transformers(monkeypatch, tmp_path):
    """The TP plan goes in distributed_config where transformers takes it there: its tp_plan= keyword warns once per
    rank (the documented TP line printed it twice); an older transformers gets the keyword."""
    import warnings

    from transformers import AutoModelForCausalLM

    import hf_dist
    from hf_dist.configs.training_args import shards_at_load
    from hf_dist.planning.features import installed_features
    from hf_dist.testing import tiny_llama_config

    layout = Layout("ddp", 2, tp_size=2)
    assert from_pretrained_kwargs(layout, LibraryFeatures(tp_distributed_config=False)) == {"tp_plan": "auto"}
    assert shards_at_load({"tp_plan": "auto"}) and shards_at_load(from_pretrained_kwargs(layout))
    assert not shards_at_load({"attn_implementation": "sdpa"}) and not shards_at_load({"distributed_config": None})
    features = installed_features()
    kwargs = hf_dist.from_pretrained_kwargs(layout)
    assert kwargs == from_pretrained_kwargs(layout, features)
    if not features.tp_distributed_config:
        pytest.skip("this transformers has no DistributedConfig(tp_plan=...): the tp_plan keyword is its form")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: transformers resolves tp_size 1 and loads unsharded
    AutoModelForCausalLM.from_config(tiny_llama_config()).save_pretrained(tmp_path)
    one_process = {"distributed_config": {"tp_plan": kwargs["distributed_config"]["tp_plan"]}}  # tp_size 2 needs 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(tmp_path, **one_process)
    assert not [str(w.message) for w in caught if "tp_plan" in str(w.message)]


def test_tp_with_ddp_replicas_is_refused_as_accelerate_would():
    with pytest.raises(ValueError, match="accelerate composes TP only with sharded data parallelism.*fsdp_full_shard"):
        strategy_args(Layout("ddp", 8, tp_size=2))


def test_hsdp_x_tp_is_three_d():
    out = strategy_args(Layout("hsdp", 16, 2, tp_size=2))["parallelism_config"]
    assert out == {"dp_replicate_size": 2, "dp_shard_size": 4, "tp_size": 2}


def test_cp_with_fsdp2():
    layout = Layout("fsdp_full_shard", 8, cp_size=2)
    assert strategy_args(layout)["parallelism_config"] == {"dp_replicate_size": 1, "dp_shard_size": 4, "cp_size": 2}
    assert from_pretrained_kwargs(layout) == {}


def test_ulysses_sp_with_zero():
    layout = Layout("zero1", 2, sp_size=2)
    out = strategy_args(layout)
    assert out["parallelism_config"] == {
        "dp_replicate_size": 1,
        "dp_shard_size": 1,
        "sp_size": 2,
        "sp_backend": "deepspeed",
        "sp_attn_implementation": "sdpa",
    }
    assert out["deepspeed"]["sequence_parallel_size"] == 2
    assert from_pretrained_kwargs(layout) == {"attn_implementation": "sdpa"}


def test_autotp_goes_into_the_deepspeed_json_not_parallelism_config():
    layout = Layout("zero2", 8, tp_size=2)
    out = strategy_args(layout)
    assert out["deepspeed"]["tensor_parallel"] == {"autotp_size": 2}
    assert "parallelism_config" not in out and from_pretrained_kwargs(layout) == {}


def test_no_model_parallel_keys_when_unused():
    for name in ("ddp", "zero3", "fsdp_full_shard"):
        out = strategy_args(Layout(name, 8))
        assert "parallelism_config" not in out
        if "deepspeed" in out:
            assert not {"tensor_parallel", "sequence_parallel_size", "aio"} & set(out["deepspeed"])
    assert parallelism_kwargs(Layout("ddp", 8)) == {"dp_replicate_size": 8, "dp_shard_size": 1}


@pytest.mark.parametrize(
    "layout",
    [
        Layout("fsdp_full_shard", 8, tp_size=2),
        Layout("fsdp_full_shard", 8, cp_size=2),
        Layout("ddp", 2, tp_size=2),
        Layout("zero2", 8, sp_size=4),
        Layout("hsdp", 16, 2, tp_size=2),
    ],
)
def test_accelerate_builds_the_parallelism_config(layout):
    """The installed accelerate builds the mesh hf_dist emits; a dimension it lacks is refused before that."""
    from hf_dist.auto import build_parallelism_config
    from hf_dist.planning.features import installed_features

    features = installed_features()
    if layout.sp_size > 1 and not features.sequence_parallel:  # accelerate < 1.12 (make test-min)
        with pytest.raises(ValueError, match=f"sp_size {layout.sp_size} needs .*accelerate >= 1.12"):
            strategy_args(layout, features=features)
        return
    if layout.tp_size > 1 and layout.dp_size > 1 and not features.tp_distributed_config:  # transformers < 5.23
        with pytest.raises(
            ValueError, match=f"tp_size 2 with {layout.dp_size} data-parallel ranks needs transformers"
        ):
            strategy_args(layout, features=features)
        return
    pc = build_parallelism_config(strategy_args(layout, features=features)["parallelism_config"])
    assert pc.total_size == layout.world_size
    assert (pc.tp_size, pc.cp_size, getattr(pc, "sp_size", 1)) == (layout.tp_size, layout.cp_size, layout.sp_size)
    if layout.sp_size > 1:
        assert pc.sp_handler.sp_attn_implementation == "sdpa"


# ---------------------------------------------------------------- features: versions that lack a dimension


@pytest.mark.parametrize(
    "layout, missing, match",
    [
        (Layout("zero2", 4, sp_size=2), "sequence_parallel", "sp_size 2 needs .*accelerate >= 1.12"),
        (Layout("fsdp_full_shard", 4, tp_size=2), "parallelism_config", "tp_size 2 needs .*accelerate >= 1.10"),
        (Layout("fsdp_full_shard", 4, cp_size=2), "parallelism_config", "cp_size 2 needs .*accelerate >= 1.10"),
        (Layout("zero1", 4, tp_size=2), "deepspeed_autotp", "AutoTP.*deepspeed >= 0.16.4"),
    ],
)
def test_versions_that_lack_a_dimension_are_refused(layout, missing, match):
    with pytest.raises(ValueError, match=match):
        strategy_args(layout, features=LibraryFeatures(**{missing: False}))


def test_installed_features_are_probed():
    """The probes (fields and modules, not version numbers) agree with the release notes of the installed versions."""
    from importlib.metadata import version

    from packaging.version import Version

    from hf_dist.planning.features import installed_features

    features = installed_features()
    accelerate, deepspeed = Version(version("accelerate")), Version(version("deepspeed"))
    assert features.parallelism_config == (accelerate >= Version("1.10"))
    assert features.sequence_parallel == (accelerate >= Version("1.12") and deepspeed >= Version("0.18.2"))
    assert features.deepspeed_autotp == (deepspeed >= Version("0.16.4"))
    # accelerate 1.15 checkpoints the FSDP2 unit itself; 1.10-1.14 each of its children (read in their sources)
    assert features.fsdp2_checkpoints_children == (accelerate < Version("1.15"))


# ---------------------------------------------------------------- DeepSpeed JSON: NVMe and AutoTP


def test_nvme_offload_writes_path_buffers_and_aio():
    cfg = deepspeed_config("zero3", offload="optimizer+params", offload_device="nvme", nvme_path="/local_nvme/ds")
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {
        "device": "nvme",
        "nvme_path": "/local_nvme/ds",
        "pin_memory": True,
        "buffer_count": 4,
        "fast_init": False,
    }
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_param"]["nvme_path"] == "/local_nvme/ds"
    assert cfg["aio"] == AIO_DEFAULTS


def test_nvme_optimizer_only():
    zero = deepspeed_config("zero3", offload="optimizer", offload_device="nvme", nvme_path="/n")["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "nvme" and "offload_param" not in zero


@pytest.mark.parametrize("path", [None, ""])
def test_nvme_without_path_is_refused(path):
    with pytest.raises(ValueError, match="offload_device 'nvme' needs nvme_path"):
        deepspeed_config("zero3", offload="optimizer+params", offload_device="nvme", nvme_path=path)
    with pytest.raises(ValueError, match="needs nvme_path"):
        strategy_args(Layout("zero3", 8, offload="optimizer", offload_device="nvme"), nvme_path=path)


@pytest.mark.parametrize("strategy, offload", [("zero2", "optimizer"), ("zero3", "none")])
def test_nvme_needs_zero3_with_offload(strategy, offload):
    with pytest.raises(ValueError, match="ZeRO-Infinity, which needs zero3"):
        deepspeed_config(strategy, offload=offload, offload_device="nvme", nvme_path="/n")


def test_autotp_needs_zero_stage_le_2():
    with pytest.raises(ValueError, match="AutoTP runs with ZeRO stage <= 2"):
        deepspeed_config("zero3", tp_size=2)


def test_unknown_offload_device():
    with pytest.raises(ValueError, match="offload_device"):
        deepspeed_config("zero3", offload="optimizer", offload_device="disk")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"strategy": "zero3", "offload": "optimizer+params", "offload_device": "nvme", "nvme_path": "/local_nvme"},
        {"strategy": "zero2", "tp_size": 2},
        {"strategy": "zero1", "sp_size": 2},
    ],
)
def test_deepspeed_parses_the_model_parallel_json(kwargs):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = json.loads(json.dumps(deepspeed_config(**kwargs)))
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1)
    cfg["gradient_clipping"] = 1.0
    zero = cfg["zero_optimization"]
    if zero.get("stage3_param_persistence_threshold") == "auto":
        zero["stage3_param_persistence_threshold"] = 4096
    parsed = DeepSpeedConfig(cfg)
    if "nvme_path" in kwargs:
        assert parsed.zero_config.offload_optimizer.device == "nvme"
        assert str(parsed.zero_config.offload_param.nvme_path) == "/local_nvme"
        assert parsed.aio_config == AIO_DEFAULTS  # what DeepSpeed would use without the block
    if "tp_size" in kwargs:
        assert parsed.tensor_parallel_config.autotp_size == 2


# ---------------------------------------------------------------- runtime checks of NVMe and probes


def unwritable_folder(tmp_path):
    """A folder this process cannot create files in: read-only by mode, or sysfs for root (which ignores modes)."""
    import os
    from pathlib import Path

    if os.geteuid() == 0:
        return Path("/sys/kernel")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


def test_nvme_path_must_exist_be_writable_and_hold_the_swap_files(tmp_path):
    import shutil

    from hf_dist.runtime.support import check_nvme_offload

    with pytest.raises(ValueError, match="needs nvme_path"):
        check_nvme_offload(None, aio_available=True)
    with pytest.raises(ValueError, match="does not exist"):
        check_nvme_offload(str(tmp_path / "missing"), aio_available=True)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="is not a folder"):
        check_nvme_offload(str(tmp_path / "a-file"), aio_available=True)
    with pytest.raises(ValueError, match="is not writable"):
        check_nvme_offload(str(unwritable_folder(tmp_path)), aio_available=True)
    # a disk that is full, or too small for the plan's swap files: its real free space against the plan's need
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match=r"GiB free, but the plan's swap files need .* on each node"):
        check_nvme_offload(str(tmp_path), free + 2**30, aio_available=True)
    check_nvme_offload(str(tmp_path), free // 2, aio_available=True)
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"], "the write probe leaves nothing behind"


def test_nvme_without_libaio_is_refused(tmp_path):
    from hf_dist.runtime.support import check_nvme_offload

    with pytest.raises(ValueError, match="libaio is missing"):
        check_nvme_offload(str(tmp_path), aio_available=False)
    check_nvme_offload(str(tmp_path), aio_available=True)


def test_probe_is_by_feature(monkeypatch):
    from hf_dist.planning import features as support

    monkeypatch.setattr(support, "_parallelism_fields", lambda: {"dp_replicate_size", "dp_shard_size", "tp_size"})
    features = support.probe_features()
    assert not features.parallelism_config and not features.sequence_parallel  # accelerate < 1.10 shape
    monkeypatch.setattr(support, "_parallelism_fields", lambda: {"tp_size", "cp_size"})  # 1.10/1.11: no sp
    features = support.probe_features()
    assert features.parallelism_config and not features.sequence_parallel
    with pytest.raises(ValueError, match="sp_size 2 needs"):
        strategy_args(Layout("zero2", 2, sp_size=2), features=features)
    monkeypatch.setattr(support, "_deepspeed_has", lambda relative: False)
    assert not support.probe_features().deepspeed_autotp


def test_accelerate_yaml_refuses_what_the_features_lack():
    from hf_dist.configs.accelerate import accelerate_config

    with pytest.raises(ValueError, match="sp_size 2 needs"):
        accelerate_config("zero2", sp_size=2, features=LibraryFeatures(sequence_parallel=False))
    with pytest.raises(ValueError, match="tp_size 2 needs"):
        accelerate_config("fsdp_full_shard", tp_size=2, features=LibraryFeatures(parallelism_config=False))


# ---------------------------------------------------------------- auto_args with a model-parallel layout


@pytest.fixture
def plan_with_layout(monkeypatch):
    """A real plan whose layout is replaced in every plan made (the planner choosing the sizes is tested with the
    planner)."""
    from hf_dist.planning import planner
    from hf_dist.testing import tiny_llama_config

    def make(strategy, **layout_kwargs):
        p = planner.plan(tiny_llama_config(), strategy=strategy, gpus=4, gpu_memory_gib=80, seq_len=64,
                         global_batch_size=16)  # fmt: skip
        layout = Layout(strategy, p.world_size, p.nodes, p.offload, p.activation_checkpointing, p.mixed_precision)
        layout = dataclasses.replace(layout, **layout_kwargs)
        result = planner._result
        monkeypatch.setattr(planner, "_result", lambda *a, **k: dataclasses.replace(result(*a, **k), layout=layout))
        return dataclasses.replace(p, layout=layout), layout

    yield make
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def test_auto_args_builds_the_sp_parallelism_config(plan_with_layout):
    from hf_dist.auto import auto_args
    from hf_dist.planning.features import installed_features
    from hf_dist.testing import tiny_llama_config

    p, layout = plan_with_layout("zero2", sp_size=2)
    if not installed_features().sequence_parallel:  # accelerate < 1.12 (make test-min): refused, never dropped
        with pytest.raises(ValueError, match="sp_size 2 needs .*upgrade accelerate and deepspeed"):
            auto_args(tiny_llama_config(), plan=p)
        return
    kw = auto_args(tiny_llama_config(), plan=p)
    pc = kw["parallelism_config"]
    assert (pc.sp_size, pc.sp_backend, pc.sp_handler.sp_attn_implementation) == (2, "deepspeed", "sdpa")
    assert pc.data_parallel_size == 2 and kw["deepspeed"]["sequence_parallel_size"] == 2


@NEEDS_TP_LOAD
def test_auto_args_builds_the_fsdp_tp_parallelism_config(plan_with_layout):
    from hf_dist.auto import auto_args
    from hf_dist.testing import tiny_llama_config

    p, layout = plan_with_layout("fsdp_full_shard", tp_size=2)
    kw = auto_args(tiny_llama_config(), plan=p)
    assert (kw["parallelism_config"].tp_size, kw["parallelism_config"].dp_shard_size) == (2, 2)
    load = from_pretrained_kwargs(layout)["distributed_config"]
    assert kw["fsdp"] and (load["tp_size"], load["fsdp_size"]) == (2, 2)


def test_auto_args_nvme_offload(plan_with_layout, tmp_path, monkeypatch):
    from hf_dist.auto import auto_args
    from hf_dist.runtime import support
    from hf_dist.testing import tiny_llama_config

    p, _ = plan_with_layout("zero3", offload="optimizer", offload_device="nvme")
    with pytest.raises(ValueError, match="needs nvme_path"):
        auto_args(tiny_llama_config(), plan=p, cpu_adam=False)
    monkeypatch.setattr(support, "_async_io_available", lambda: False)
    with pytest.raises(ValueError, match="libaio is missing"):
        auto_args(tiny_llama_config(), plan=p, cpu_adam=False, nvme_path=str(tmp_path))
    monkeypatch.setattr(support, "_async_io_available", lambda: True)
    kw = auto_args(tiny_llama_config(), plan=p, cpu_adam=False, nvme_path=str(tmp_path))
    offload = kw["deepspeed"]["zero_optimization"]["offload_optimizer"]
    # the parameter swap buffers hold the model's largest partition (DeepSpeed asserts it), sized from the plan
    from hf_dist.planning import model_states as memory

    p, _ = plan_with_layout("zero3", offload="optimizer+params", offload_device="nvme")
    monkeypatch.setattr(memory, "nvme_param_buffer", lambda spec, degree: 131_334_144)
    params = auto_args(tiny_llama_config(), plan=p, cpu_adam=False, nvme_path=str(tmp_path))["deepspeed"]
    assert params["zero_optimization"]["offload_param"]["buffer_size"] == 131_334_144
    with pytest.raises(ValueError, match="is not writable"):  # the plan's checks run before any config is written
        auto_args(tiny_llama_config(), plan=p, cpu_adam=False, nvme_path=str(unwritable_folder(tmp_path)))
    assert (offload["device"], offload["nvme_path"]) == ("nvme", str(tmp_path)) and "aio" in kw["deepspeed"]


def test_deepspeed_json_path_keeps_what_inline_keys_cannot_say():
    from hf_dist.configs.accelerate import accelerate_config

    cfg = accelerate_config("zero3", sp_size=2, deepspeed_config_file="ds.json")
    assert cfg["deepspeed_config"]["deepspeed_config_file"] == "ds.json"
    assert cfg["parallelism_config"]["parallelism_config_sp_size"] == 2
    assert (
        accelerate_config("zero2", tp_size=2, deepspeed_config_file="ds.json")["deepspeed_config"][
            "deepspeed_config_file"
        ]
        == "ds.json"
    )
