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


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            package, version = line.split("==")
            pins[_norm(package)] = version.strip()
    return pins


def _readme_matrix() -> dict[str, dict[str, str]]:
    """README's "Supported versions" table: {row label: {package: first version in its cell}}."""
    section = (ROOT / "README.md").read_text().split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
    packages = [_norm(name) for name in rows[0][1:]]
    return {
        row[0]: {p: re.search(r"\d+(\.\d+)+", cell).group() for p, cell in zip(packages, row[1:], strict=True)}
        for row in rows[2:]
    }


def _testing_md_newest() -> dict[str, str]:
    """docs/testing.md's matrix: {package: the newest tested column's version} for the single-package rows."""
    text = (ROOT / "docs" / "testing.md").read_text().split("## Supported versions", 1)[1].split("\n\n", 2)[1]
    out = {}
    for line in text.splitlines()[2:]:
        name, _, newest = (cell.strip() for cell in line.strip().strip("|").split("|"))
        if _norm(name) in MATRIX_PACKAGES:
            out[_norm(name)] = re.match(r"\d+(\.\d+)+", newest).group()
    return out


def test_the_newest_tested_set_is_one_fact_in_readme_docs_constraints_and_support():
    """README's table, docs/testing.md, constraints/newest.txt (what `make install` installs: README said
    transformers 5.23.0 while `make test` installed 5.24.0), the Makefile's torch and NEWEST_TESTED agree."""
    from packaging.version import Version

    newest, lowest = _pins("newest.txt"), _pins("min.txt")
    makefile = (ROOT / "Makefile").read_text()
    torch = re.search(r"^TORCH_SPEC \?= torch==([0-9.]+)$", makefile, re.M).group(1)
    assert re.search(r"^NEWEST \?= constraints/newest.txt$", makefile, re.M)
    assert '$(if $(NEWEST),-c $(NEWEST)) -e ".[dev,trl]"' in makefile  # the venv of make demo / make test
    assert {**{p: newest[p] for p in MATRIX_PACKAGES if p != "torch"}, "torch": torch} == NEWEST_TESTED
    # every package make install installs from pyproject (torch by TORCH_SPEC, liger-kernel never) is pinned
    assert set(newest) == set(lowest) - {"torch", "liger_kernel"}
    assert all(Version(newest[p]) >= Version(lowest[p]) for p in newest)
    readme = _readme_matrix()
    assert set(readme["newest tested (`make test`)"]) == set(MATRIX_PACKAGES)
    assert readme["newest tested (`make test`)"] == NEWEST_TESTED
    low = readme["lowest (tested by `make test-min`)"]
    assert {p: Version(v) for p, v in low.items()} == {p: Version(lowest[p]) for p in MATRIX_PACKAGES}
    assert _testing_md_newest() == NEWEST_TESTED


def test_env_marks_a_version_newer_than_the_newest_tested(capsys, monkeypatch):
    import hf_dist.cli.env as env

    newer = f"{int(NEWEST_TESTED['transformers'].split('.')[0])}.99.0"
    monkeypatch.setattr(env, "versions", lambda: {"torch": NEWEST_TESTED["torch"], "transformers": newer})
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    expected = f"transformers    {newer}  <- outside the tested range: newer than the newest tested "
    assert expected + NEWEST_TESTED["transformers"] in out
    assert re.search(r"torch\s+\S+\n", out)  # the newest tested torch: nothing said
