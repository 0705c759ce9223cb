"""hf_dist.runtime.cpu_fsdp: the opt-in that keeps accelerate's FSDP2 plugin on CPU ranks.

The in-process tests build a real 1-rank gloo process group, so accelerate's state is MULTI_CPU
exactly as on 2 CPU ranks; tests/distributed/ checks the 2-rank outcome (DTensor shards, DCP).
"""

from __future__ import annotations

import os
import warnings

import pytest

from hf_dist.runtime import cpu_fsdp
from hf_dist.testing import free_port

_USE_FSDP_AT_IMPORT = os.environ.get("ACCELERATE_USE_FSDP")


@pytest.fixture
def restore_patch():
    """Leave AcceleratorState.__init__ as found."""
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__
    yield
    cpu_fsdp.disable_fsdp_on_cpu()
    assert AcceleratorState.__init__ is original


@pytest.fixture
def one_cpu_rank(monkeypatch, restore_patch):
    """A fresh accelerate state on a 1-rank gloo group, torn down afterwards."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    env = {
        "ACCELERATE_USE_CPU": "1",
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # setenv (not delenv) so the "true" that Accelerator(fsdp_plugin=...) writes is undone afterwards.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def fsdp2_plugin(version: int = 2):
    from accelerate.utils import FullyShardedDataParallelPlugin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP1 deprecation notice
        return FullyShardedDataParallelPlugin(fsdp_version=version)


def make_accelerator(**kwargs):
    from accelerate import Accelerator

    return Accelerator(**kwargs)


def test_enable_is_idempotent_warns_and_disable_restores(restore_patch):
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__
    assert not cpu_fsdp.fsdp_on_cpu_enabled()
    with pytest.warns(RuntimeWarning, match="tests and CPU development only"):
        cpu_fsdp.enable_fsdp_on_cpu()
    patched = AcceleratorState.__init__
    assert patched is not original and cpu_fsdp.fsdp_on_cpu_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second call neither re-wraps nor warns again
        cpu_fsdp.enable_fsdp_on_cpu()
    assert AcceleratorState.__init__ is patched
    cpu_fsdp.disable_fsdp_on_cpu()
    assert AcceleratorState.__init__ is original and not cpu_fsdp.fsdp_on_cpu_enabled()


@pytest.mark.parametrize(("value", "enabled"), [(None, False), ("0", False), ("false", False), ("1", True)])
def test_enable_from_env(monkeypatch, restore_patch, value, enabled):
    if value is None:
        monkeypatch.delenv(cpu_fsdp.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cpu_fsdp.ENV_VAR, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert cpu_fsdp.enable_fsdp_on_cpu_from_env() is enabled
    assert cpu_fsdp.fsdp_on_cpu_enabled() is enabled


def test_enable_from_env_rejects_unknown_value(monkeypatch, restore_patch):
    monkeypatch.setenv(cpu_fsdp.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=r"HF_DIST_FSDP_ON_CPU='maybe'.*use 1"):
        cpu_fsdp.enable_fsdp_on_cpu_from_env()
    assert not cpu_fsdp.fsdp_on_cpu_enabled()


def test_without_patch_accelerate_silently_drops_fsdp_on_cpu(one_cpu_rank):
    """The platform fact this module exists for: a negative control for the test below."""
    from accelerate.utils import DistributedType

    accelerator = make_accelerator(fsdp_plugin=fsdp2_plugin())
    assert accelerator.state.distributed_type == DistributedType.MULTI_CPU


def test_patch_takes_fsdp_branch_and_fully_shard_wraps(one_cpu_rank):
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from hf_dist.testing import tiny_llama_config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cpu_fsdp.enable_fsdp_on_cpu()
    plugin = fsdp2_plugin()
    accelerator = make_accelerator(fsdp_plugin=plugin)
    assert accelerator.state.distributed_type == DistributedType.FSDP
    assert accelerator.state.fsdp_plugin is plugin and accelerator.is_fsdp2
    assert PartialState().distributed_type == DistributedType.FSDP  # both singletons agree
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert type(model).__name__ == "FSDPLlamaForCausalLM"
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_patch_leaves_an_existing_state_alone(one_cpu_rank):
    """Only a fresh state is promoted: a later Accelerator with a plugin does not change a DDP run."""
    from accelerate.utils import DistributedType

    make_accelerator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cpu_fsdp.enable_fsdp_on_cpu()
    accelerator = make_accelerator(fsdp_plugin=fsdp2_plugin())
    assert accelerator.state.distributed_type == DistributedType.MULTI_CPU


def test_patch_refuses_fsdp1_on_cpu(one_cpu_rank):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cpu_fsdp.enable_fsdp_on_cpu()
    with pytest.raises(RuntimeError, match="fsdp_version=1.*fsdp_version: 2"):
        make_accelerator(fsdp_plugin=fsdp2_plugin(version=1))


def test_one_cpu_rank_leaves_no_trace():
    """Runs last (file order): nothing the tests above set leaks into later test files."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    assert not dist.is_initialized()
    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}
    assert os.environ.get("ACCELERATE_USE_FSDP") == _USE_FSDP_AT_IMPORT
