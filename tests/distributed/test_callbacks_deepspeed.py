"""Callbacks under a real DeepSpeed Trainer (2 CPU ranks over gloo): ZeRO-2 and ZeRO-3 checkpoints are marked
complete, and ExportCallback's folders (on every save and at train end) load with from_pretrained and equal an
independent conversion of the same checkpoint (ZeRO-3: the export *is* a conversion; ZeRO-2: save_pretrained of
the full module every rank holds)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_dist
from hf_dist.checkpoint.formats.contents import read_contents
from hf_dist.checkpoint.formats.names import MANIFEST_NAME

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """ZeRO-2 and ZeRO-3 runs of lifecycle_train.py, and ZeRO-2 under DeepSpeed's own LR scheduler, in one 2-rank
    launch (scripts/runs.py)."""
    from tests.distributed.conftest import torchrun_runs

    outs = {stage: tmp_path_factory.mktemp(stage) for stage in ("zero2", "zero3", "ds_scheduler")}
    runs = [["lifecycle_train", "--output-dir", str(out), "--max-steps", "4", "--save-steps", "2", "--deepspeed", stage,
             "--export"] for stage, out in outs.items() if stage != "ds_scheduler"]  # fmt: skip
    runs.append(["lifecycle_train", "--output-dir", str(outs["ds_scheduler"]), "--max-steps", "4", "--save-steps", "2",
                 "--deepspeed", "zero2", "--ds-scheduler"])  # fmt: skip
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
    assert read_contents(out / "checkpoint-4").world_size == 2
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


def test_a_deepspeed_scheduler_checkpoint_has_no_scheduler_pt_and_is_proven_without_its_manifest(runs, tmp_path):
    """What the Trainer writes when the DeepSpeed config names its own scheduler: no scheduler.pt (its state is in
    DeepSpeed's model-states file). Without hf_dist's manifest (a run without attach), the proof accepts it and
    auto_resume resumes it, rather than taking the missing file for an incomplete save."""
    from hf_dist.checkpoint.lifecycle.proof import unproven_reasons
    from hf_dist.checkpoint.safety.loading import safe_load

    written = runs["ds_scheduler"] / "checkpoint-4"
    assert not (written / "scheduler.pt").exists() and (runs["zero2"] / "checkpoint-4" / "scheduler.pt").is_file()
    states = safe_load(written / "global_step4" / "mp_rank_00_model_states.pt")
    assert states["lr_scheduler"]["last_batch_iteration"] == 3  # WarmupLR stepped 4 times, from -1
    ckpt = tmp_path / "checkpoint-4"  # as a run without attach leaves it: no manifest, no hf_dist run record
    shutil.copytree(written, ckpt, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    assert unproven_reasons(ckpt, 2) == []
    assert hf_dist.auto_resume(tmp_path, strategy="zero2", world_size=2) == str(ckpt)
