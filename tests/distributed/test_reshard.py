"""Train on 2 CPU ranks, resume on 1 and on 3: FSDP2 (DCP resharding) and ZeRO-3 (universal checkpoint).

The reference run trains 6 steps and saves at step 3; each resumed run loads checkpoint-3 at another world
size and trains steps 4-6. The global batch is the same at every world size, so the resumed losses must equal
the uninterrupted ones. Tolerance: 1e-4 relative (measured differences are <= 1e-6: only the order of the
gradient reduction changes). Steps 5 and 6 depend on Adam's moments, and the recorded Adam step counter must
read 6, so a resume that restarted the optimizer fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_dist.reshard import inspect_checkpoint
from hf_dist.testing import torchrun

SCRIPT = Path(__file__).parent / "scripts" / "reshard_train.py"
RTOL = 1e-4
# DeepSpeed takes its branch only when accelerate is not forced onto CPU; it falls back to gloo by itself
LAUNCH_ENV = {"fsdp": {}, "zero3": {"ACCELERATE_USE_CPU": "0"}}

pytestmark = pytest.mark.distributed


def train(backend: str, out: Path, nproc: int, resume: Path | None = None) -> dict:
    loss_file = out / "result.json"
    args = ["--backend", backend, "--out", out, "--loss-file", loss_file, "--max-steps", 6, "--save-steps", 3]
    if resume is not None:
        args += ["--resume", resume]
    torchrun(SCRIPT, args, nproc=nproc, env=LAUNCH_ENV[backend], timeout=300)
    return json.loads(loss_file.read_text())


@pytest.fixture(scope="module", params=["fsdp", "zero3"])
def reference(request, tmp_path_factory):
    backend = request.param
    out = tmp_path_factory.mktemp(f"{backend}_ws2")
    result = train(backend, out, nproc=2)
    return backend, out / "checkpoint-3", result


def check_strategy_ran(backend: str, result: dict) -> None:
    if backend == "fsdp":
        assert result["model_type"].startswith("FSDP"), result  # FSDP2 really wrapped the model
    else:
        assert result["wrapped"] == "DeepSpeedEngine", result


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_on_other_world_size(reference, new_world, tmp_path):
    backend, checkpoint, ref = reference
    check_strategy_ran(backend, ref)
    saved = inspect_checkpoint(checkpoint)
    assert saved.world_size == 2
    assert saved.kind == ("dcp" if backend == "fsdp" else "deepspeed")

    resumed = train(backend, tmp_path, nproc=new_world, resume=checkpoint)

    check_strategy_ran(backend, resumed)
    assert resumed["world_size"] == new_world
    assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(ref["losses"][step], rel=RTOL), f"step {step}: {loss} vs {ref['losses'][step]}"
    assert resumed["adam_step"] == ref["adam_step"] == 6  # optimizer state restored, not restarted
    if backend == "zero3":
        assert inspect_checkpoint(checkpoint).universal_tag == "global_step3_universal"


def test_cli_reshard_into_copy(reference, tmp_path, capsys):
    from hf_dist.cli.main import main

    backend, checkpoint, _ = reference
    dst = tmp_path / "any-world"
    assert main(["reshard", str(checkpoint), str(dst), "--overwrite"]) == 0
    out = capsys.readouterr().out
    if backend == "fsdp":
        assert "nothing to convert" in out
        assert (dst / "pytorch_model_fsdp_0").is_dir()
        return
    copied = inspect_checkpoint(dst)
    assert copied.universal_tag == "global_step3_universal" and copied.world_size == 2
    # one folder per parameter with its fp32 weights and both Adam moments
    q_proj = dst / "global_step3_universal" / "zero" / "model.layers.0.self_attn.q_proj.weight"
    assert {p.name for p in q_proj.iterdir()} >= {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"}
