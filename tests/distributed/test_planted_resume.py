"""A real Trainer resumed under ``attach`` on 2 CPU ranks refuses a planted checkpoint, with no early check at all.

Each strategy's checkpoint comes from its session launch (conftest ``strategy_runs``, shared with
test_strategies.py); a copy gets an attack planted, and one run per strategy resumes it with
``trainer.train(resume_from_checkpoint=PATH)`` after ``attach(trainer)`` (the runs of one engine, planted copies first,
then the clean controls, in one launch: scripts/runs.py), without ``auto_resume``: only the guarded
loads stand between the files and the libraries (DeepSpeed's ``load_checkpoint`` unpickles with
``weights_only=False``, accelerate's FSDP optimizer load is DCP, whose byte values are ``torch.load(weights_only=
False)``, the Trainer follows links). Every rank must refuse, naming the file; the payload never runs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import CASES, TRAIN_STEPS, launch_env
from tests.unit.checkpoint.safety.payloads import Payload, plant

pytestmark = pytest.mark.distributed

SCRIPT_ARGS = ["--steps", TRAIN_STEPS + 1]


def _copy(strategy_runs, name: str, tmp_path: Path) -> Path:
    source = Path(strategy_runs.get(name)["workdir"]) / "run" / f"checkpoint-{TRAIN_STEPS}"
    ckpt = tmp_path / "run" / source.name
    shutil.copytree(source, ckpt)
    return ckpt


def _plant_ddp(ckpt: Path, marker: Path) -> str:
    """optimizer.pt linked to a file outside (the Trainer's own weights_only load would follow the link)."""
    outside = marker.parent / "elsewhere"
    outside.mkdir()
    shutil.move(ckpt / "optimizer.pt", outside / "optimizer.pt")
    (ckpt / "optimizer.pt").symlink_to(outside / "optimizer.pt")
    return rf"refusing to read {ckpt / 'optimizer.pt'}: it resolves to .*elsewhere"


def _plant_fsdp(ckpt: Path, marker: Path) -> str:
    """accelerate's optimizer_0/ rewritten with a payload where the param groups' learning rate goes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = ckpt / "optimizer_0"
    dcp_to_torch_save(folder, ckpt / "optim.pt")  # our own clean file, read in full
    state = torch.load(ckpt / "optim.pt", weights_only=False)
    (ckpt / "optim.pt").unlink()
    state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    shutil.rmtree(folder)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return rf"refusing to load a value stored in {folder}/__0_0\.distcp: it names the global posix\.mkdir"


def _plant_zero3(ckpt: Path, marker: Path) -> str:
    """Every rank's optimizer file in the zip that torch and Python's zipfile read differently."""
    for file in sorted(ckpt.glob("global_step*/*optim_states.pt")):
        plant(file, marker, "two directories")
    return r"refusing to load .*optim_states\.pt: it names the global posix\.mkdir"


def _plant_zero2(ckpt: Path, marker: Path) -> str:
    """``latest`` naming a tag folder outside the checkpoint, holding a planted copy."""
    tag = (ckpt / "latest").read_text().strip()
    outside = marker.parent / "elsewhere"
    shutil.copytree(ckpt / tag, outside / tag)
    for file in sorted((outside / tag).glob("*.pt")):
        plant(file, marker)
    (ckpt / "latest").write_text(f"../../elsewhere/{tag}")
    return rf"refusing to read {ckpt / 'latest'}: it names '\.\./\.\./elsewhere/{tag}'"


ATTACKS = {"ddp": _plant_ddp, "fsdp_full_shard": _plant_fsdp, "zero3": _plant_zero3, "zero2": _plant_zero2}
CLEAN = ("ddp", "fsdp_full_shard", "zero3")


@pytest.fixture(scope="module")
def resumes(strategy_runs, tmp_path_factory):
    """(planted|clean, strategy) -> (report, expected refusal, payload marker): every resume of one engine in one
    launch (scripts/runs.py), each from its own copy of the strategy's session checkpoint."""
    from hf_dist.testing import retry_gloo_abort

    done: dict[tuple[str, str], tuple] = {}

    def get(kind: str, name: str) -> tuple:
        if (kind, name) not in done:
            group = CASES[name].group
            keys = [(k, n) for k, names in (("planted", sorted(ATTACKS)), ("clean", CLEAN)) for n in names
                    if CASES[n].group == group]  # fmt: skip
            try:
                done.update(retry_gloo_abort(lambda _: _launch(keys, strategy_runs, tmp_path_factory)))
            except Exception as exc:  # cached: each test of the launch fails with it
                done.update(dict.fromkeys(keys, exc))
        result = done[kind, name]
        if isinstance(result, BaseException):
            raise RuntimeError(f"the resume launch failed (cached): {result}") from result
        return result

    return get


def _launch(keys, strategy_runs, tmp_path_factory) -> dict:
    from tests.distributed.conftest import torchrun_runs

    runs, facts = [], {}
    for kind, name in keys:
        tmp = tmp_path_factory.mktemp(f"{kind}_{name}")
        ckpt = _copy(strategy_runs, name, tmp)
        marker = tmp / "PAYLOAD_RAN"
        expected = ATTACKS[name](ckpt, marker) if kind == "planted" else None
        out = tmp / "report.json"
        case = CASES[name]
        runs.append(["strategies_train", "--strategy", case.strategy, *map(str, SCRIPT_ARGS),
                     "--output-dir", str(tmp / "run2"), "--out", str(out), "--resume-from", str(ckpt)])  # fmt: skip
        facts[kind, name] = (out, expected, marker)
    env = launch_env(CASES[keys[0][1]].strategy)
    if CASES[keys[0][1]].strategy == "ddp":
        env = {**env, "ACCELERATE_USE_CPU": "0"}
    torchrun_runs(runs, tmp_path_factory.mktemp("resumes") / "runs.json", env=env, outputs=[])
    return {key: (json.loads(out.read_text()), expected, marker) for key, (out, expected, marker) in facts.items()}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_trainer_resume_under_attach_refuses_on_every_rank(name, resumes):
    report, expected, marker = resumes("planted", name)
    assert report["refused"] in ("UnsafePickleError", "PathEscapeError"), report
    assert re.search(expected, report["message"]), report["message"]
    assert not marker.exists()


@pytest.mark.parametrize("name", CLEAN)
def test_a_clean_copy_resumes_under_attach(name, resumes):
    """The control, and the allowlist against real files: the same resume, in the same launch, of an untouched copy
    trains on (numpy's RNG state; accelerate's DCP optimizer; DeepSpeed's real ZeRO stage and loss scaler classes).
    ``make test-min`` runs it on the lowest supported versions too."""
    report, _, _ = resumes("clean", name)
    assert report == {"refused": None, "global_step": TRAIN_STEPS + 1}
