"""ZeRO-Infinity checkpoints: the sub-group cut the reader relies on, and the resume repair's no-op cases.

The repair itself and reading the swap files run on a real 2-rank checkpoint in tests/distributed/test_nvme_offload.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_dist.callbacks.resume import ZeroInfinityResumeCallback
from hf_dist.checkpoint.formats.deepspeed import zero3_sub_groups
from hf_dist.checkpoint.lifecycle.zero_infinity import zero_infinity_optimizer


def test_sub_groups_are_cut_where_deepspeed_cuts_them():
    shapes = [{"a": (10,), "b": (10,), "c": (10,)}, {"norm": (3,)}]
    # per rank: 5, 5, 5 | 2; a group is cut once its partitions reach sub_group_size, and at its last param
    assert zero3_sub_groups(shapes, 2, 8) == [10, 5, 2]
    assert zero3_sub_groups(shapes, 2, 10) == [10, 5, 2]
    assert zero3_sub_groups(shapes, 2, 100) == [15, 2]
    assert zero3_sub_groups(shapes, 2, None) == [15, 2]


def test_only_a_swapping_zero3_optimizer_is_repaired():
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert zero_infinity_optimizer(None) is None and zero_infinity_optimizer(adam) is None
    cpu_offload = SimpleNamespace(swap_optimizer=False, optimizer=adam)
    assert zero_infinity_optimizer(SimpleNamespace(optimizer=cpu_offload)) is None
    nvme = SimpleNamespace(swap_optimizer=True, optimizer=adam)
    assert zero_infinity_optimizer(SimpleNamespace(optimizer=nvme)) is nvme  # behind accelerate's wrapper


def test_resume_callback_leaves_other_runs_alone(tmp_path):
    callback = ZeroInfinityResumeCallback()
    args = SimpleNamespace(output_dir=str(tmp_path))
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    # a resumed run without NVMe offload, and a fresh NVMe run: nothing to read (tmp_path holds no checkpoint)
    callback.on_train_begin(args, SimpleNamespace(global_step=4), None, optimizer=adam)
    nvme = SimpleNamespace(swap_optimizer=True)
    callback.on_train_begin(args, SimpleNamespace(global_step=0), None, optimizer=nvme)


def test_a_deepspeed_without_the_internals_is_refused_not_half_repaired(tmp_path):
    from hf_dist.checkpoint.lifecycle.zero_infinity import restore_resident_subgroups

    other_version = SimpleNamespace(swap_optimizer=True, fp32_partitioned_groups_flat=[])
    with pytest.raises(RuntimeError, match="cannot repair this ZeRO-Infinity resume: .*'optimizer_swapper'"):
        restore_resident_subgroups(other_version, tmp_path)


def test_the_guarded_deepspeed_load_repairs_a_zero_infinity_resume_under_its_guard(tmp_path, monkeypatch):
    """DeepSpeed's NVMe load never opens ``*_optim_states.pt``: attach's guarded load reads them itself, inside the
    guard (so a planted file is refused there, never skipped), and the callback then leaves the optimizer alone."""
    import transformers.trainer as trainer_module

    from hf_dist.checkpoint.lifecycle import zero_infinity
    from hf_dist.checkpoint.safety import loading, trainer_loads

    calls = []

    def load(engine, path, load_module_strict=True):
        calls.append(("deepspeed", path))

    def repair(optimizer, checkpoint, *, trust_pickles=False):
        calls.append(("repair", str(checkpoint), loading.active_root()))
        optimizer._hf_dist_restored_from = str(checkpoint)
        return 0

    monkeypatch.setattr(trainer_module, "deepspeed_load_checkpoint", load)
    monkeypatch.setattr(zero_infinity, "restore_resident_subgroups", repair)
    nvme = SimpleNamespace(swap_optimizer=True)
    with trainer_loads.deepspeed_load_guarded():
        trainer_module.deepspeed_load_checkpoint(SimpleNamespace(optimizer=nvme), str(tmp_path))
    assert trainer_module.deepspeed_load_checkpoint is load  # the library's own function is back
    assert calls == [("deepspeed", str(tmp_path)), ("repair", str(tmp_path), tmp_path)]
    ZeroInfinityResumeCallback().on_train_begin(
        SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=2), None, optimizer=nvme
    )
    assert len(calls) == 2  # not repaired twice
    cpu_offload = SimpleNamespace(swap_optimizer=False)
    with trainer_loads.deepspeed_load_guarded():
        trainer_module.deepspeed_load_checkpoint(SimpleNamespace(optimizer=cpu_offload), str(tmp_path))
    assert calls[2:] == [("deepspeed", str(tmp_path))]
