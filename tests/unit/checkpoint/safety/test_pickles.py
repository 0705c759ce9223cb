import argparse
import sys
import types

import pytest
import torch

from hf_dist.checkpoint.safety.pickles import (
    CorruptCheckpointError,
    LossScalerStub,
    UnsafePickleError,
    ZeroStageStub,
    safe_load,
)


@pytest.fixture
def fake_deepspeed_classes(monkeypatch):
    """Classes pickled under deepspeed's dotted names, without importing deepspeed."""
    made = {}
    for module_name, class_name, base in (
        ("deepspeed.runtime.zero.config", "ZeroStageEnum", int),
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", object),
    ):
        parts = module_name.split(".")
        for i in range(1, len(parts)):  # fake parents too, whether or not real deepspeed is imported
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        module = types.ModuleType(module_name)
        cls = type(class_name, (base,), {"__module__": module_name})
        setattr(module, class_name, cls)
        monkeypatch.setitem(sys.modules, module_name, module)
        made[class_name] = cls
    return made


def test_deepspeed_metadata_types_load_as_inert_stubs(tmp_path, fake_deepspeed_classes):
    scaler = fake_deepspeed_classes["LossScaler"]()
    scaler.cur_scale = 1024.0
    path = tmp_path / "optim.pt"
    torch.save(
        {"zero_stage": fake_deepspeed_classes["ZeroStageEnum"](3), "loss_scaler": scaler, "w": torch.ones(3)}, path
    )
    state = safe_load(path)
    assert isinstance(state["zero_stage"], ZeroStageStub) and int(state["zero_stage"]) == 3
    assert isinstance(state["loss_scaler"], LossScalerStub) and state["loss_scaler"].cur_scale == 1024.0
    assert torch.equal(state["w"], torch.ones(3))


def test_foreign_type_is_refused_naming_file_and_type(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"args": argparse.Namespace(lr=1.0)}, path)
    with pytest.raises(UnsafePickleError, match=r"evil\.pt.*argparse\.Namespace.*--trust-pickles"):
        safe_load(path)
    assert safe_load(path, trust_pickles=True)["args"].lr == 1.0


def test_truncated_and_empty_files_name_the_file(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.arange(10000.0)}, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:3000])
    with pytest.raises(CorruptCheckpointError, match=r"truncated\.pt.*truncated or corrupt"):
        safe_load(truncated)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CorruptCheckpointError, match=r"empty\.pt is empty"):
        safe_load(empty)
