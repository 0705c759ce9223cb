"""Callbacks under a real DeepSpeed Trainer (2 CPU ranks over gloo): ZeRO-2 and ZeRO-3 checkpoints are marked
complete, and ExportCallback's folders (on every save and at train end) load with from_pretrained and equal an
independent conversion of the same checkpoint (ZeRO-3: the export *is* a conversion; ZeRO-2: save_pretrained of
the full module every rank holds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_dist
from hf_dist.checkpoint.formats.layout import read_layout
from hf_dist.checkpoint.formats.names import MANIFEST_NAME

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """ZeRO-2 and ZeRO-3 runs of lifecycle_train.py, in one 2-rank launch (scripts/runs.py)."""
    from tests.distributed.conftest import torchrun_runs

    outs = {stage: tmp_path_factory.mktemp(stage) for stage in ("zero2", "zero3")}
    runs = [["lifecycle_train", "--output-dir", str(out), "--max-steps", "4", "--save-steps", "2", "--deepspeed", stage,
             "--export"] for stage, out in outs.items()]  # fmt: skip
    spec = tmp_path_factory.mktemp("deepspeed") / "runs.json"
    torchrun_runs(runs, spec, env={"ACCELERATE_USE_CPU": "0"}, outputs=list(outs.values()))
    return outs


@pytest.fixture(params=["zero2", "zero3"])
def run(request, runs):
    return request.param, runs[request.param]


def test_deepspeed_really_ran_and_checkpoints_are_marked(run):
    stage, out = run
    facts = json.loads((out / "facts.json").read_text())
    assert (facts["wrapped"], facts["zero_stage"]) == ("DeepSpeedEngine", int(stage[-1]))
    for step in (2, 4):
        marker = json.loads((out / f"checkpoint-{step}" / MANIFEST_NAME).read_text())
        assert (marker["strategy"], marker["world_size"]) == (stage, 2)
        assert marker["layout"] == ("zero3" if stage == "zero3" else "zero12")
        assert f"global_step{step}/zero_pp_rank_1_mp_rank_00_optim_states.pt" in marker["files"]
    assert read_layout(out / "checkpoint-4").world_size == 2
    assert hf_dist.auto_resume(out, strategy=stage) == str(out / "checkpoint-4")


def test_exports_load_and_equal_offline_conversion(run, tmp_path):
    from transformers import AutoModelForCausalLM

    _, out = run
    for step, exported in ((2, out / "checkpoint-2" / "hf_model"), (4, out / "checkpoint-4" / "hf_model"),
                           (4, out / "hf_model")):  # fmt: skip
        reference_dir = tmp_path / f"ref{step}"
        if not reference_dir.exists():
            hf_dist.convert(out / f"checkpoint-{step}", reference_dir, progress=False)
        reference = load_file(reference_dir / "model.safetensors")
        got = load_file(exported / "model.safetensors")
        assert got.keys() == reference.keys(), exported
        assert all(torch.equal(got[k], reference[k]) for k in reference), exported
        model = AutoModelForCausalLM.from_pretrained(exported)
        assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    # the step-2 export is of step 2's weights, not the final ones
    first, last = (
        load_file(out / "checkpoint-2/hf_model/model.safetensors"),
        load_file(out / "hf_model/model.safetensors"),
    )
    assert not torch.equal(
        first["model.layers.0.self_attn.q_proj.weight"], last["model.layers.0.self_attn.q_proj.weight"]
    )
