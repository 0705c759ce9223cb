"""Train on 2 CPU ranks, resume on 1 and on 3: FSDP2 (DCP resharding) and ZeRO-1/2/3 (universal checkpoint).

The reference run trains 6 steps and saves at step 3; each resumed run loads checkpoint-3 at another world
size and trains steps 4-6. The global batch is the same at every world size, so the resumed losses must equal
the uninterrupted ones. Tolerance: 1e-4 relative (measured differences are <= 1e-6: only the order of the
gradient reduction changes). Steps 5 and 6 depend on Adam's moments, and the recorded Adam step counter must
read 6, so a resume that restarted the optimizer fails.

Resumes on 3 ranks go through ``hf_dist.auto_resume(out, training_args=...)`` on a copy of checkpoint-3 without
any universal folder (what a user restarting the job on another GPU count does); resumes on 1 rank through
``prepare_resume(checkpoint-3)``. ZeRO-1 and ZeRO-2 write the same files; ZeRO-1 is resumed on 3 ranks only. The runs
of one engine (FSDP2, DeepSpeed) at one world size share a launch (scripts/runs.py): 6 launches for the 11 runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_dist.checkpoint.lifecycle.reshard import inspect_checkpoint

RTOL = 1e-4
# DeepSpeed takes its branch only when accelerate is not forced onto CPU; it falls back to gloo by itself
LAUNCH_ENV = {"fsdp": {}, "zero1": {"ACCELERATE_USE_CPU": "0"}, "zero2": {"ACCELERATE_USE_CPU": "0"},
              "zero3": {"ACCELERATE_USE_CPU": "0"}}  # fmt: skip
CASES = [("fsdp", 1), ("fsdp", 3), ("zero3", 1), ("zero3", 3), ("zero2", 1), ("zero2", 3), ("zero1", 3)]

pytestmark = pytest.mark.distributed


def _argv(backend: str, out: Path, resume: Path | None = None, auto: bool = False) -> list[str]:
    args = ["reshard_train", "--backend", backend, "--out", out, "--loss-file", out / "result.json"]
    args += ["--max-steps", 6, "--save-steps", 3]
    if resume is not None:
        args += ["--resume", resume]
    if auto:
        args += ["--auto-resume"]
    return list(map(str, args))


def train(runs: dict[str, list[str]], nproc: int, spec: Path) -> None:
    """Each backend's run (``backend -> argv``), all of one engine, in one launch of ``nproc`` ranks."""
    from tests.distributed.conftest import torchrun_runs

    env = LAUNCH_ENV[next(iter(runs))]
    outputs = [Path(argv[argv.index("--out") + 1]) for argv in runs.values()]
    torchrun_runs(list(runs.values()), spec, env=env, outputs=outputs, nproc=nproc)


def _engine(backend: str) -> str:
    return "fsdp" if backend == "fsdp" else "deepspeed"


def _launched(cache: dict, key, keys: list, launch):
    """``cache[key]``, filling the cache with ``launch()``'s results for ``keys`` (a failure cached for each)."""
    if key not in cache:
        try:
            cache.update(launch())
        except Exception as exc:
            cache.update(dict.fromkeys(keys, exc))
    result = cache[key]
    if isinstance(result, BaseException):
        raise RuntimeError(f"the launch of {key} failed (cached): {result}") from result
    return result


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """backend -> (checkpoint-3 of a 6-step run on 2 ranks, its result); the runs of one engine in one launch."""
    cache: dict = {}

    def get(backend: str) -> tuple[Path, dict]:
        backends = sorted({b for b, _ in CASES if _engine(b) == _engine(backend)})

        def launch() -> dict:
            outs = {b: tmp_path_factory.mktemp(f"{b}_ws2") for b in backends}
            train({b: _argv(b, out) for b, out in outs.items()}, 2, tmp_path_factory.mktemp("refs") / "runs.json")
            return {
                b: (out / "checkpoint-3", json.loads((out / "result.json").read_text())) for b, out in outs.items()
            }

        return _launched(cache, backend, backends, launch)

    return get


@pytest.fixture(scope="module")
def resumed(references, tmp_path_factory):
    """(backend, world) -> (the checkpoint it resumed, its result): the resumes of one engine at one world size in
    one launch. On 3 ranks the job restarts in its own output folder holding a copy of checkpoint-3 without any
    universal folder (``auto_resume``); on 1 rank it resumes checkpoint-3 itself (``prepare_resume``)."""
    cache: dict = {}

    def get(backend: str, world: int) -> tuple[Path, dict]:
        keys = [(b, w) for b, w in CASES if w == world and _engine(b) == _engine(backend)]

        def launch() -> dict:
            runs, checkpoints, outs = {}, {}, {}
            for b, _ in keys:
                checkpoint, _ = references(b)
                outs[b] = out = tmp_path_factory.mktemp(f"{b}_ws{world}")
                if world == 3:
                    shutil.copytree(checkpoint, out / checkpoint.name, ignore=shutil.ignore_patterns("*_universal"))
                    runs[b], checkpoints[b] = _argv(b, out, auto=True), out / checkpoint.name
                else:
                    runs[b], checkpoints[b] = _argv(b, out, resume=checkpoint), checkpoint
            train(runs, world, tmp_path_factory.mktemp("resumes") / "runs.json")
            return {(b, world): (checkpoints[b], json.loads((outs[b] / "result.json").read_text())) for b, _ in keys}

        return _launched(cache, (backend, world), keys, launch)

    return get


def check_strategy_ran(backend: str, result: dict) -> None:
    if backend == "fsdp":
        assert result["model_type"].startswith("FSDP"), result  # FSDP2 really wrapped the model
    else:
        assert result["wrapped"] == "DeepSpeedEngine", result
        assert result["zero_stage"] == int(backend[-1]), result


@pytest.mark.parametrize(("backend", "new_world"), CASES, ids=[f"{b}-ws{w}" for b, w in CASES])
def test_resume_on_other_world_size(references, resumed, backend, new_world):
    checkpoint, ref = references(backend)
    check_strategy_ran(backend, ref)
    saved = inspect_checkpoint(checkpoint)
    assert saved.world_size == 2
    assert saved.format == ("dcp" if backend == "fsdp" else "deepspeed")

    checkpoint, resumed = resumed(backend, new_world)
    check_strategy_ran(backend, resumed)
    assert resumed["world_size"] == new_world
    assert sorted(resumed["losses"], key=int) == ["4", "5", "6"]
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(ref["losses"][step], rel=RTOL), f"step {step}: {loss} vs {ref['losses'][step]}"
    assert resumed["adam_step"] == ref["adam_step"] == 6  # optimizer state restored, not restarted
    if backend != "fsdp":
        assert inspect_checkpoint(checkpoint).universal_tag == "global_step3_universal"


@pytest.mark.parametrize("backend", ["fsdp", "zero3", "zero2"])
def test_cli_reshard_into_copy(references, backend, tmp_path, capsys):
    from hf_dist.cli.main import main

    checkpoint, _ = references(backend)
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
