"""The tested support matrix: which versions of the libraries hf_dist plugs into CI has run it with.

The lowest supported version of each is pyproject.toml's lower bound; ``constraints/min.txt`` pins all of
them at once and ``make test-min`` tests that set. The newest tested is :data:`NEWEST_TESTED`: the versions
``constraints/newest.txt`` pins, with which ``make install`` installs ``make demo``'s and ``make test``'s venv (torch:
the Makefile's ``TORCH_SPEC``). ``hf-dist env`` reports an installed version outside ``[lowest, newest tested]``.
README.md and docs/testing.md list the matrix; tests/unit/runtime/test_support.py checks that all of them agree.
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
    "trl",
)

# newest versions the full suite passed with (`make test`, torch 2.13.0+cpu): constraints/newest.txt pins them
NEWEST_TESTED = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "accelerate": "1.15.0",
    "deepspeed": "0.19.8",
    "peft": "0.21.2",
    "datasets": "5.2.0",
    "safetensors": "0.8.0",
    "huggingface_hub": "2.4.0",
    "trl": "1.16.0",
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


def check_nvme_offload(nvme_path: str | None, swap_bytes: int = 0, *, aio_available=None) -> None:
    """Refuse NVMe offload (ZeRO-Infinity) before training starts, with the fix: ``nvme_path`` must be a folder
    this process can create files in (probed by writing one), its disk must have ``swap_bytes`` free (the plan's
    swap files per node, ``Plan.swap_bytes``), and DeepSpeed's async-I/O op must be buildable (it needs libaio).
    ``aio_available`` replaces the libaio probe in tests."""
    import os
    import shutil
    import tempfile

    if not nvme_path:
        raise ValueError(
            "NVMe offload needs nvme_path: a writable folder on a local NVMe drive on every node "
            "(auto_args(..., nvme_path='/local_nvme/ds_offload'), hf-dist config --nvme-path ...)"
        )
    if not os.path.isdir(nvme_path):
        raise ValueError(
            f"nvme_path {nvme_path!r} does not exist or is not a folder; create it on a local NVMe drive on every "
            "node and make it writable by the training user"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=nvme_path, prefix=".hf_dist-write-probe-"):
            pass
    except OSError as exc:
        raise ValueError(
            f"nvme_path {nvme_path!r} is not writable ({exc.strerror}); DeepSpeed writes its swap files there: "
            "make it writable by the training user, or choose a folder on another local drive"
        ) from exc
    free = shutil.disk_usage(nvme_path).free
    if free < swap_bytes:
        raise ValueError(
            f"nvme_path {nvme_path!r} has {free / 2**30:.2f} GiB free, but the plan's swap files need "
            f"{swap_bytes / 2**30:.2f} GiB on each node (Plan.swap_bytes: optimizer states, gradients and parameters "
            "beyond max_in_cpu); free space there, choose a larger drive, or train on more GPUs"
        )
    available = _async_io_available() if aio_available is None else aio_available
    if not available:
        raise ValueError(
            "NVMe offload needs DeepSpeed's async_io op, which cannot be built here: libaio is missing "
            "(install libaio-dev with apt, or libaio-devel with dnf/yum; `make test` installs it where apt runs as "
            "root); offload to CPU instead (offload_device='cpu')"
        )


def _async_io_available() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return False
    return bool(AsyncIOBuilder().is_compatible(verbose=False))
