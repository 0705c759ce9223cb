"""No code from a model folder runs from the command line unless the user says so (issue 30): ``hf-dist plan``
(and ``--verify``), ``hf-dist bench`` and the recipes' model config. ``hf-dist convert`` / ``verify``:
tests/unit/checkpoint/test_remote_code.py; the Python API: tests/unit/planning/test_remote_code.py.

The folders are :mod:`tests.unit.planning.remote_fakes`'; a marker folder appearing means their code ran.
"""

from __future__ import annotations

import json
import re

import pytest

from hf_dist import recipe_utils as ru
from hf_dist.cli.main import main
from hf_dist.data import build_tokenizer
from hf_dist.planning.remote_code import RemoteCodeError
from hf_dist.testing import REPO_ROOT
from tests.unit.planning.remote_fakes import REFUSED, plant, refusal_pattern

PLAN = ["--gpus", "8", "--gpu-memory", "80"]


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "MARKER"


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    prefix = f"hf-dist {command}: error: "
    assert err.startswith(prefix), err
    return err.removeprefix(prefix)


@pytest.mark.parametrize("variant", REFUSED)
@pytest.mark.parametrize("extra", ([], ["--verify"], ["--json"]), ids=("plain", "verify", "json"))
def test_hf_dist_plan_refuses_in_one_line_and_exits_1(tmp_path, marker, capsys, variant, extra):
    folder = plant(tmp_path / "model", variant, marker)
    assert main(["plan", str(folder), *PLAN, *extra]) == 1
    assert re.match(refusal_pattern(folder, variant), _one_line_error(capsys, "plan"))
    assert not marker.exists()


def test_hf_dist_plan_of_a_llama_folder_ignores_its_auto_map(tmp_path, marker, capsys):
    folder = plant(tmp_path / "model", "llama", marker)
    assert main(["plan", str(folder), *PLAN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] and not marker.exists()


def test_hf_dist_plan_with_the_flag_imports_and_plans_the_folder_model(tmp_path, marker, capsys):
    """The control, and the docs' line (docs/planner.md): ``hf-dist plan ./custom-model --gpus 8 --gpu-memory 80
    --trust-remote-code``."""
    folder = plant(tmp_path / "custom-model", "unknown", marker)
    assert main(["plan", str(folder), *PLAN, "--trust-remote-code"]) == 0
    assert marker.exists() and "chosen: ddp" in capsys.readouterr().out


def test_hf_dist_bench_refuses_before_launching_anything(tmp_path, marker, capsys):
    folder = plant(tmp_path / "model", "t5", marker)
    assert main(["bench", "--nproc", "2", "--model", str(folder)]) == 1
    assert re.match(refusal_pattern(folder, "t5"), _one_line_error(capsys, "bench")) and not marker.exists()


@pytest.mark.parametrize("variant", REFUSED)
def test_the_recipe_model_config_refuses_without_trust_remote_code(tmp_path, marker, variant):
    folder = plant(tmp_path / "model", variant, marker)
    args = ru.ModelArguments(model_name_or_path=str(folder))
    with pytest.raises(RemoteCodeError) as caught:
        ru.model_config(args, tokenizer=None)
    assert re.match(refusal_pattern(folder, variant), str(caught.value)) and not marker.exists()


def test_the_sft_recipe_stops_before_building_anything(tmp_path, marker, monkeypatch):
    folder = plant(tmp_path / "model", "t5", marker)
    build_tokenizer().save_pretrained(tmp_path / "tokenizer")
    built = []
    monkeypatch.setattr(ru, "build_model", lambda *a, **k: built.append(1))
    sft = ru.load_recipe(REPO_ROOT / "recipes" / "sft.py")
    argv = ["--model_name_or_path", str(folder), "--tokenizer_name_or_path", str(tmp_path / "tokenizer"),
            "--output_dir", str(tmp_path / "out"), "--use_cpu"]  # fmt: skip
    from hf_dist.recipe_utils.refusal import RecipeRefusal

    with pytest.raises(RecipeRefusal, match=r"modeling_evil\.py.*--trust-remote-code"):  # printed once by the recipe
        sft.main(argv)
    assert built == [] and not marker.exists()


@pytest.mark.parametrize(("variant", "config_class"), (("unknown", "EvilConfig"), ("llama", "LlamaConfig")))
def test_the_recipe_model_config_with_the_flag(tmp_path, marker, variant, config_class):
    """``--trust_remote_code``: the folder's code is imported where it defines the config (the marker appears); a
    llama folder's config is transformers' own either way."""
    folder = plant(tmp_path / "model", variant, marker)
    config = ru.model_config(ru.ModelArguments(model_name_or_path=str(folder), trust_remote_code=True), None)
    assert type(config).__name__ == config_class
    assert marker.exists() == (variant == "unknown")
    untrusted = (
        ru.model_config(ru.ModelArguments(model_name_or_path=str(folder)), None) if variant == "llama" else None
    )
    assert untrusted is None or type(untrusted).__name__ == "LlamaConfig"
