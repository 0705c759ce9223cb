"""A TraceSetup holds one Layout: built flat or from a layout, read back flat, sent to the tracing process as a flat
JSON that comes back equal, and the plan's layout is the setup's."""

import json

import pytest

import hf_dist
from hf_dist.planning.hardware import Hardware
from hf_dist.planning.layout import Layout
from hf_dist.testing import tiny_llama_config
from hf_dist.tracing.setup import TraceSetup


def test_flat_fields_and_a_layout_build_the_same_setup():
    layout = Layout("zero2", 8, offload="optimizer", activation_checkpointing=True, mixed_precision="no")
    flat = TraceSetup("zero2", world_size=8, offload="optimizer", activation_checkpointing=True,
                      mixed_precision="no", method="lora", seq_len=64)  # fmt: skip
    assert TraceSetup(layout=layout, method="lora", seq_len=64) == flat
    assert flat.layout == layout and flat.strategy == "zero2" and flat.world_size == 8 and flat.seq_len == 64


def test_the_wire_format_is_flat_and_reads_back_equal():
    setup = TraceSetup("fsdp_full_shard", world_size=4, sync_each_batch=True, method="lora", micro_batch_size=2)
    data = json.loads(json.dumps(setup.to_dict()))
    assert data["strategy"] == "fsdp_full_shard" and data["sync_each_batch"] is True and "layout" not in data
    assert TraceSetup.from_dict(data) == setup


def test_contradicting_or_unknown_fields_are_refused_by_name():
    with pytest.raises(TypeError, match=r"takes no layout fields beside it; got \['world_size'\]"):
        TraceSetup(layout=Layout("ddp", 2), world_size=4)
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['seqlen'\]; allowed: .*'seq_len'"):
        TraceSetup("ddp", seqlen=64)
    with pytest.raises(ValueError, match="strategy"):
        TraceSetup("zero4")


def test_a_plans_setup_holds_the_plans_layout():
    hw = Hardware(device="cuda", gpus_per_node=8, gpu_memory_gib=24.0, peak_tflops=100.0)
    chosen = hf_dist.plan(tiny_llama_config(), hardware=hw, seq_len=64, global_batch_size=64, strategy="zero3")
    assert TraceSetup.from_plan(chosen).layout == chosen.layout
