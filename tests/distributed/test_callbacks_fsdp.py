"""Callbacks under real FSDP2 (2 CPU ranks over gloo, hf_dist.runtime.cpu_fsdp): DCP checkpoints marked complete,
the gathered export equals an independent conversion, a DDP resume of them is refused, and async_save writes the
same checkpoints in the background."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_dist
from hf_dist.checkpoint.formats.contents import read_contents
from hf_dist.checkpoint.formats.names import MANIFEST_NAME
from hf_dist.testing import REPO_ROOT, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests/distributed/scripts/lifecycle_train.py"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    torchrun(
        SCRIPT,
        ["--output-dir", out, "--max-steps", "4", "--save-steps", "2", "--fsdp", "--export"],
        timeout=300,
        outputs=[out],
    )
    return out


def test_fsdp_really_ran_and_its_dcp_checkpoints_are_marked(run_dir):
    assert json.loads((run_dir / "facts.json").read_text())["model_class"] == "FSDPLlamaForCausalLM"
    marker = json.loads((run_dir / "checkpoint-4" / MANIFEST_NAME).read_text())
    assert (marker["strategy"], marker["layout"], marker["world_size"]) == ("fsdp_full_shard", "fsdp", 2)
    assert {"pytorch_model_fsdp_0/__0_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"} <= set(marker["files"])
    assert read_contents(run_dir / "checkpoint-4").world_size == 2
    assert hf_dist.auto_resume(run_dir, strategy="fsdp_full_shard") == str(run_dir / "checkpoint-4")


def test_export_of_sharded_model_equals_offline_conversion(run_dir, tmp_path):
    hf_dist.convert(run_dir / "checkpoint-4", tmp_path / "ref", model_config=run_dir / "hf_model", progress=False)
    reference = load_file(tmp_path / "ref" / "model.safetensors")
    for exported in (run_dir / "hf_model", run_dir / "checkpoint-4" / "hf_model"):
        got = load_file(exported / "model.safetensors")
        assert got.keys() == reference.keys()
        assert all(torch.equal(got[k], reference[k]) for k in reference)


def test_resuming_fsdp_checkpoint_into_ddp_is_refused(run_dir):
    with pytest.raises(
        RuntimeError, match=r"(?s)cannot resume a ddp run .*FSDP distributed checkpoint.*hf-dist convert"
    ):
        hf_dist.auto_resume(run_dir, strategy="ddp")


def test_a_normal_run_with_rank_0_exports_on_save_names_no_straggler(run_dir):
    """Every save exports the gathered model on rank 0 (slow, one rank): saves come between steps, so no alarm."""
    steps = [h for h in json.loads((run_dir / "log_history.json").read_text()) if "loss" in h]
    assert len(steps) == 4 and all(h["perf/tokens_per_s"] > 0 for h in steps)
    assert not [k for h in steps for k in h if k.startswith("perf/straggler")], steps


def dcp_contents(folder: Path) -> dict:
    """Every value of a DCP folder (our own test run's, so torch.load may unpickle), by flattened key; read through a
    file outside the checkpoint, whose manifest lists exactly what the save wrote."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    copy = Path(tempfile.mkdtemp()) / f"{folder.name}.pt"
    dcp_to_torch_save(folder, copy)
    flat: dict = {}

    def walk(value, key):
        if isinstance(value, dict | list | tuple):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                walk(v, f"{key}.{k}")
        else:
            flat[key] = value

    walk(torch.load(copy, weights_only=False), "")
    return flat


def test_async_save_writes_the_synchronous_checkpoint_while_training_goes_on(run_dir, tmp_path):
    """FSDP2 with async_save: each background write first sleeps 1 s (the steps go on meanwhile), yet every DCP
    value of the model and the optimizer equals the synchronous run's, and both checkpoints are marked."""
    out = tmp_path / "async"
    torchrun(SCRIPT, ["--output-dir", out, "--max-steps", "4", "--save-steps", "2", "--fsdp", "--async-save",
                      "--slow-write", "1"], timeout=300, outputs=[out])  # fmt: skip
    stalls = json.loads((out / "facts.json").read_text())["save_stalls_s"]
    assert len(stalls) == 2 and max(stalls) < 1.0, stalls  # each save's writes took > 1 s: the steps did not wait
    for step in (2, 4):
        marker = json.loads((out / f"checkpoint-{step}" / MANIFEST_NAME).read_text())
        assert marker["layout"] == "fsdp" and marker["world_size"] == 2
        for sub in ("pytorch_model_fsdp_0", "optimizer_0"):
            want, got = (
                dcp_contents(run_dir / f"checkpoint-{step}" / sub),
                dcp_contents(out / f"checkpoint-{step}" / sub),
            )
            assert got.keys() == want.keys()
            for key, value in want.items():
                same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
                assert same, f"checkpoint-{step}/{sub}{key} differs from the synchronous save"
    assert hf_dist.auto_resume(out, strategy="fsdp_full_shard") == str(out / "checkpoint-4")
