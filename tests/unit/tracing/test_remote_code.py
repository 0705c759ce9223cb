"""No code from a model folder runs in a trace unless the user says so (issue 30): ``trace_memory`` and
``plan(verify=True)``, in this process and in the trace's worker process.

The folders are :mod:`tests.unit.planning.remote_fakes`'; a marker folder appearing means their code ran.
"""

from __future__ import annotations

import re

import pytest

import hf_dist
from hf_dist.planning.model_source import load_config
from hf_dist.planning.remote_code import RemoteCodeError
from tests.unit.planning.remote_fakes import REFUSED, plant, refusal_pattern

SETUP = {"strategy": "ddp", "world_size": 1, "seq_len": 16, "micro_batch_size": 1}


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "MARKER"


@pytest.mark.parametrize("variant", REFUSED)
@pytest.mark.parametrize("isolate", (True, False))
def test_trace_memory_refuses_before_any_worker_starts(tmp_path, marker, variant, isolate):
    folder = plant(tmp_path / "model", variant, marker)
    with pytest.raises(RemoteCodeError) as caught:
        hf_dist.trace_memory(str(folder), isolate=isolate, **SETUP)
    assert not marker.exists()
    assert re.match(refusal_pattern(folder, variant), str(caught.value)), caught.value


def test_a_config_object_naming_code_is_refused_in_the_trace(tmp_path, marker):
    config = load_config(str(plant(tmp_path / "model", "t5", marker)))  # T5Config, its auto_map kept as data
    with pytest.raises(RemoteCodeError, match=r"modeling_evil\.py.*--trust-remote-code"):
        hf_dist.trace_memory(config, isolate=False, **SETUP)
    assert not marker.exists()


@pytest.mark.parametrize("variant", REFUSED)
def test_plan_verify_refuses(tmp_path, marker, variant):
    folder = plant(tmp_path / "model", variant, marker)
    with pytest.raises(RemoteCodeError):
        hf_dist.plan(str(folder), gpus=1, gpu_memory_gib=80, verify=True)
    assert not marker.exists()


def test_a_registered_causal_lm_is_traced_in_its_worker_without_the_folder_code(tmp_path, marker):
    """plan(verify=True) of a llama folder with an auto_map: planned and traced (in the worker process) with
    transformers' LlamaForCausalLM; the worker gets the config as data, never the folder."""
    folder = plant(tmp_path / "model", "llama", marker)
    plan = hf_dist.plan(str(folder), gpus=1, gpu_memory_gib=80, global_batch_size=1, seq_len=16, verify=True)
    assert not marker.exists()
    assert plan.trace is not None and plan.trace.peak_bytes > 0, plan.verification


def test_with_the_flag_the_worker_imports_the_folder_code_and_traces_it(tmp_path, marker):
    """The control: trusted, the folder's code is imported (the marker appears) and its model traced; only that code
    can build the folder's ``evil`` config, so the worker's trace proves the worker got the flag and the folder."""
    folder = plant(tmp_path / "model", "unknown", marker)
    traced = hf_dist.trace_memory(str(folder), trust_remote_code=True, **SETUP)
    assert marker.exists() and traced.peak_bytes > 0
