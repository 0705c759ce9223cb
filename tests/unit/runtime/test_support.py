"""The support matrix: pyproject's lower bounds, constraints/min.txt and `hf-dist env` tell the same story."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_dist.cli.main import main
from hf_dist.runtime.support import MATRIX_PACKAGES, NEWEST_TESTED, declared_minimums, support_status

ROOT = Path(__file__).resolve().parents[3]


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def test_min_constraints_pin_every_declared_lower_bound():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *(r for reqs in project["optional-dependencies"].values() for r in reqs)]
    bounds = {}
    for text in declared:
        name, low = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", text).groups()
        bounds[_norm(name)] = low
    pins = {}
    for line in (ROOT / "constraints" / "min.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[_norm(name)] = version.strip()
    assert pins == bounds, "constraints/min.txt must pin every pyproject.toml lower bound, and only those"
    assert set(MATRIX_PACKAGES) <= set(bounds) and set(NEWEST_TESTED) == set(MATRIX_PACKAGES)


def test_status_flags_versions_outside_the_tested_range():
    lowest = declared_minimums()
    assert lowest["transformers"]  # read from hf_dist's installed metadata
    status = support_status(
        {
            "torch": NEWEST_TESTED["torch"] + "+cpu",  # a local build label is the same version
            "transformers": "4.57.0",
            "accelerate": "99.0.0",
            "peft": lowest["peft"],
            "deepspeed": None,  # not installed: nothing to say
        }
    )
    assert status["torch"] is None and status["peft"] is None and "deepspeed" not in status
    assert (
        status["transformers"]
        == f"older than the lowest supported {lowest['transformers']} (pyproject.toml); upgrade it"
    )
    assert status["accelerate"].startswith(f"newer than the newest tested {NEWEST_TESTED['accelerate']}")


def test_env_names_a_version_outside_the_range(capsys, monkeypatch):
    import hf_dist.cli.env as env

    monkeypatch.setattr(env, "versions", lambda: {"torch": "2.13.0", "transformers": "4.57.0", "hf_dist": "0.1.0"})
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"transformers\s+4\.57\.0  <- outside the tested range: older than the lowest supported", out)
    assert "docs/testing.md" in out
