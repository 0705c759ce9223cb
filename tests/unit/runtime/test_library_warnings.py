"""torch's deprecation of DeepSpeed's collectives: said once per process, not at every step."""

from __future__ import annotations

import warnings

from hf_dist.runtime import library_warnings


def _torch_says():
    warnings.warn(
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single`",
        FutureWarning,
        stacklevel=1,
    )


def test_deprecated_collectives_are_said_once(monkeypatch):
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))  # the test's filters are undone after it
    monkeypatch.setattr(library_warnings, "_quieted", False)
    with warnings.catch_warnings(record=True) as before:
        warnings.simplefilter("default")
        for _ in range(3):  # what a step does: torch warns, a library's catch_warnings resets the registry
            _torch_says()
            with warnings.catch_warnings():
                pass
    assert len(before) == 3  # the control: Python alone repeats it
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("default")
        for _ in range(3):
            library_warnings.quiet_deprecated_collectives()
            _torch_says()
            with warnings.catch_warnings():
                pass
    assert [str(w.message)[:40] for w in after] == ["DeepSpeed calls torch.distributed.all_ga"]
