"""The tested support matrix: which versions of the libraries hf_dist plugs into CI has run it with.

The lowest supported version of each is pyproject.toml's lower bound; ``constraints/min.txt`` pins all of
them at once and ``make test-min`` tests that set. The newest is whatever ``make test`` installs; the set a CI
run last passed with is recorded in :data:`NEWEST_TESTED` (update it with the run). ``hf-dist env`` reports
an installed version outside ``[lowest, newest tested]``. docs/testing.md lists the matrix.
"""

from __future__ import annotations

import importlib.metadata

# the libraries whose APIs hf_dist calls into; their versions decide whether it works
MATRIX_PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "deepspeed",
    "peft",
    "datasets",
    "safetensors",
    "huggingface_hub",
)

# newest versions the full suite passed with (`make test`, torch 2.13.0+cpu, 2026-11-23)
NEWEST_TESTED = {
    "torch": "2.13.0",
    "transformers": "5.23.0",
    "accelerate": "1.15.0",
    "deepspeed": "0.19.8",
    "peft": "0.21.2",
    "datasets": "5.2.0",
    "safetensors": "0.8.0",
    "huggingface_hub": "2.4.0",
}


def declared_minimums() -> dict[str, str]:
    """``{package: lowest version}`` from hf_dist's installed metadata (pyproject.toml's ``>=`` bounds)."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("hf_dist") or []
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return {}
    out: dict[str, str] = {}
    for text in requires:
        req = Requirement(text)
        name = req.name.lower().replace("-", "_")
        for spec in req.specifier:
            if spec.operator == ">=":
                out[name] = spec.version
    return out


def support_status(installed: dict[str, str | None]) -> dict[str, str | None]:
    """``{package: None if inside the tested range, else a sentence saying how it is outside}``."""
    from packaging.version import Version

    lowest = declared_minimums()
    out: dict[str, str | None] = {}
    for name in MATRIX_PACKAGES:
        version = installed.get(name)
        if version is None:
            continue
        low, high = lowest.get(name), NEWEST_TESTED.get(name)
        base = Version(Version(version).base_version)  # 2.13.0+cpu is 2.13.0
        if low is not None and base < Version(low):
            out[name] = f"older than the lowest supported {low} (pyproject.toml); upgrade it"
        elif high is not None and base > Version(high):
            out[name] = f"newer than the newest tested {high}; untested, report problems with `hf-dist env`"
        else:
            out[name] = None
    return out
