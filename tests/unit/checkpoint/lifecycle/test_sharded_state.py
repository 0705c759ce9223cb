"""hf_dist.checkpoint.lifecycle.sharded_state and ShardedResumeCallback in one process (the TP runs on 2 and 4 ranks are in
tests/distributed/test_tensor_parallel.py)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hf_dist.callbacks.resume import ShardedResumeCallback
from hf_dist.checkpoint.formats.contents import read_contents
from hf_dist.checkpoint.formats.names import SHARDED_OPTIM
from hf_dist.checkpoint.lifecycle import sharded_state
from hf_dist.planning.layout import CheckpointFamily
from hf_dist.testing import free_port


def trained(seed: int = 0):
    """A small model, AdamW and a linear-decay LambdaLR after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 10)
    model(torch.randn(3, 8)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_optimizer_and_scheduler_round_trip(tmp_path):
    model, optimizer, scheduler = trained()
    folder = sharded_state.save_optimizer_state(tmp_path, model, optimizer, scheduler)
    assert (folder / ".metadata").is_file() and sharded_state.has_optimizer_state(tmp_path)
    assert json.loads((tmp_path / sharded_state.SCHEDULER_FILE).read_text())["last_epoch"] == 1

    fresh_model, fresh_optimizer, fresh_scheduler = trained(seed=1)  # other moments, same shapes
    fresh_model.load_state_dict(model.state_dict())
    wrapped = SimpleNamespace(optimizer=fresh_optimizer)  # accelerate's AcceleratedOptimizer keeps it here
    sharded_state.load_optimizer_state(tmp_path, fresh_model, wrapped, fresh_scheduler)
    want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for index, state in want["state"].items():
        assert all(torch.equal(value, got["state"][index][key]) for key, value in state.items())
    assert fresh_scheduler.state_dict()["last_epoch"] == 1 and fresh_scheduler.get_last_lr() == scheduler.get_last_lr()


def test_a_scheduler_that_is_not_json_is_refused_by_name(tmp_path):
    model, optimizer, _ = trained()
    scheduler = SimpleNamespace(state_dict=lambda: {"fn": object()})
    with pytest.raises(TypeError, match="cannot save the state of SimpleNamespace as JSON"):
        sharded_state.save_optimizer_state(tmp_path, model, optimizer, scheduler)
    assert not sharded_state.has_optimizer_state(tmp_path)  # refused before anything was written


def test_layout_requires_every_ranks_optimizer_shard(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / "hf_dist_optimizer").mkdir()
    (tmp_path / "hf_dist_optimizer" / ".metadata").write_bytes(b"m")
    (tmp_path / "hf_dist_optimizer" / "__0_0.distcp").write_bytes(b"o")
    layout = read_contents(tmp_path, strict=False)
    assert layout.family is CheckpointFamily.FULL  # the weights are a plain HF file; DDP loads them too
    assert layout.missing_rank_files(2) == [f"{SHARDED_OPTIM} of rank 1"]
    (tmp_path / "hf_dist_optimizer" / "__1_0.distcp").write_bytes(b"o")
    assert read_contents(tmp_path, strict=False).missing_rank_files(2) == []


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def sharded_linear(mesh) -> torch.nn.Module:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    model[0].weight = torch.nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Shard(0)]))
    return model


def test_full_state_dict_loads_into_dtensor_parameters(one_rank_mesh):
    model = sharded_linear(one_rank_mesh)
    full = {"0.weight": torch.full((6, 4), 0.5), "0.bias": torch.ones(6)}
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):  # what the Trainer's resume hits
        model.load_state_dict(full)
    sharded_state.accept_full_state_dict(model)
    model.load_state_dict(full)
    assert torch.equal(model[0].weight.full_tensor(), full["0.weight"]) and torch.equal(model[0].bias, full["0.bias"])
    with pytest.raises(RuntimeError, match="size mismatch"):  # a wrong shape is still reported as one
        model.load_state_dict({**full, "0.weight": torch.zeros(3, 4)})


def test_callback_wraps_only_models_sharded_at_load(one_rank_mesh, tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path))
    plain, sharded = ShardedResumeCallback(), ShardedResumeCallback()
    plain.on_init_end(args, None, None, model=torch.nn.Linear(2, 2))
    sharded.on_init_end(args, None, None, model=sharded_linear(one_rank_mesh))
    assert not plain.sharded_at_load and sharded.sharded_at_load
    resumed = SimpleNamespace(global_step=2, is_world_process_zero=True)
    plain.on_train_begin(args, resumed, None)  # a DDP checkpoint: the Trainer restores its own optimizer.pt
    with pytest.raises(RuntimeError, match="checkpoint-2 holds no optimizer state"):
        sharded.on_train_begin(args, resumed, None)
    sharded.on_train_begin(args, SimpleNamespace(global_step=0), None)  # a fresh run loads nothing


def test_a_path_from_another_runs_folder_resumes_the_optimizer(tmp_path):
    """Issue 21 item 2: a TP run's checkpoint-3 resumed by explicit path into another folder (recipes: attach(trainer,
    resume_from=PATH)) gets its Adam moments and schedule back; the callback looked only in its own output_dir."""
    model, optimizer, scheduler = trained()
    source = tmp_path / "A" / "checkpoint-3"
    sharded_state.save_optimizer_state(source, model, optimizer, scheduler)
    fresh_model, fresh_optimizer, fresh_scheduler = trained(seed=1)
    fresh_model.load_state_dict(model.state_dict())
    args = SimpleNamespace(output_dir=str(tmp_path / "B"))  # the new run's folder holds no checkpoint-3
    callback = ShardedResumeCallback(resume_from=str(source))
    callback.on_train_begin(args, SimpleNamespace(global_step=3, is_world_process_zero=True), None,
                            model=fresh_model, optimizer=fresh_optimizer, lr_scheduler=fresh_scheduler)  # fmt: skip
    for want, got in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert torch.equal(want["exp_avg"], got["exp_avg"]) and torch.equal(want["exp_avg_sq"], got["exp_avg_sq"])
    assert fresh_scheduler.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]


def test_loading_is_guarded(tmp_path):
    """DCP unpickles the optimizer's non-tensor values with weights_only=False; under the guard that load is torch's
    weights_only load, which refuses a planted one while parsing it."""
    import torch.distributed.checkpoint as dcp

    from hf_dist.checkpoint.safety.errors import UnsafePickleError
    from tests.unit.checkpoint.safety.payloads import Payload

    model, optimizer, scheduler = trained()
    sharded_state.save_optimizer_state(tmp_path, model, optimizer, scheduler)
    folder = tmp_path / "hf_dist_optimizer"
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    state["param_groups"] = Payload(tmp_path / "RAN")  # the real moments, and a payload where param_groups go
    shutil.rmtree(folder)
    dcp.save({"optimizer": state}, checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(
        UnsafePickleError, match=r"a value stored in .*__0_0\.distcp: it names the global posix\.mkdir"
    ):
        sharded_state.load_optimizer_state(tmp_path, model, optimizer, scheduler)
    assert not (tmp_path / "RAN").exists()


def test_rng_state_is_written_in_the_trainers_format(tmp_path):
    """save_only_model leaves the Trainer's RNG files out; hf_dist writes them, and the Trainer's own loader (a
    weights_only load under its safe globals) restores the generators from them."""
    import random

    import numpy as np
    from transformers import Trainer

    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    path = sharded_state.save_rng_state(tmp_path, world_size=1)
    assert path.name == "rng_state.pth"
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    trainer = SimpleNamespace(args=SimpleNamespace(world_size=1, parallel_mode=None))
    Trainer._load_rng_state(trainer, str(tmp_path))
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]
    assert sharded_state.save_rng_state(tmp_path, world_size=2).name == "rng_state_0.pth"
