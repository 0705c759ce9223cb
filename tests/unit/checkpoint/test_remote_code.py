"""No code from a checkpoint's config folder runs in ``convert`` or ``verify`` unless the user says so (issue 30).

A ZeRO-3 checkpoint (:mod:`tests.unit.checkpoint.fakes`) whose config.json is an attacker's
(:mod:`tests.unit.planning.remote_fakes`): the converter learns the expected tensor names from the config, so an
``auto_map`` there would be imported by a tool that trusts it. A marker folder appearing means the code ran.
"""

from __future__ import annotations

import re

import pytest

from hf_dist.checkpoint.conversion.convert import convert
from hf_dist.checkpoint.conversion.verify import verify
from hf_dist.cli.main import main
from hf_dist.planning.remote_code import RemoteCodeError
from tests.unit.planning.remote_fakes import REFUSED, plant, refusal_pattern


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "MARKER"


def _cli_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("variant", REFUSED)
def test_convert_and_verify_refuse_an_evil_config(zero_ckpt, tmp_path, marker, variant):
    ckpt = plant(zero_ckpt[0], variant, marker)
    for attempt in (lambda: convert(ckpt, tmp_path / "hf", progress=False), lambda: verify(ckpt, ckpt)):
        with pytest.raises(RemoteCodeError) as caught:
            attempt()
        assert re.match(refusal_pattern(ckpt, variant), str(caught.value)), caught.value
    assert not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("variant", REFUSED)
def test_the_cli_refuses_in_one_line_and_exits_1(zero_ckpt, tmp_path, marker, variant, capsys):
    ckpt = plant(zero_ckpt[0], variant, marker)
    assert main(["convert", str(ckpt), str(tmp_path / "hf")]) == 1
    assert re.match(r"hf-dist convert: error: refusing to import code from .*--trust-remote-code", _cli_error(capsys))
    assert main(["verify", str(ckpt), str(ckpt)]) == 1
    assert re.match(r"hf-dist verify: error: refusing to import code from .*--trust-remote-code", _cli_error(capsys))
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_model_config_flag_pointing_at_an_evil_folder_is_refused(zero_ckpt, tmp_path, marker, capsys):
    evil = plant(tmp_path / "base-model", "t5", marker)
    assert main(["convert", str(zero_ckpt[0]), str(tmp_path / "hf"), "--model-config", str(evil)]) == 1
    assert "refusing to import code from" in _cli_error(capsys) and not marker.exists()


def test_a_registered_llama_converts_and_verifies_with_transformers_own_class(zero_ckpt, tmp_path, marker, capsys):
    ckpt = plant(zero_ckpt[0], "llama", marker)
    assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert main(["verify", str(ckpt), str(tmp_path / "hf"), "--atol", "1e-2", "--logits"]) == 0
    assert not marker.exists()


@pytest.mark.parametrize("variant", ("unknown", "llama"))
def test_with_the_flag_the_folder_code_runs_and_the_checkpoint_converts(zero_ckpt, tmp_path, marker, variant):
    """The control: the same folders, trusted, import their code (the marker appears) and convert and verify; the
    docs' lines (docs/convert.md)."""
    ckpt = plant(zero_ckpt[0], variant, marker)
    trusted = ["--trust-remote-code"]
    assert main(["convert", str(ckpt), str(tmp_path / "hf"), *trusted]) == 0
    assert marker.exists(), "the payload did not run: the refusal tests above would pass for the wrong reason"
    assert main(["verify", str(ckpt), str(tmp_path / "hf"), "--atol", "1e-2", "--logits", *trusted]) == 0
